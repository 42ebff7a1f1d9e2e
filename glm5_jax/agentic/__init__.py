"""Asynchronous agentic RL (GLM5_SPEC.md section 3): rollout servers (server.py), the TITO gateway
(gateway.py), coordinator/router (coordinator.py), the agentic loss (loss.py), the agent pool and
calculator task (agent.py), the sync/async trainer (trainer.py), the OpenAI-style chat endpoint
(http.py); tool environments as services (envs.py) and context management (context.py).
Modules are imported directly (nothing is imported here, so Ray/HTTP stay optional)."""
