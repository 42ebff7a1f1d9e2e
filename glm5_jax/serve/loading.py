"""Model + tokenizer for serving from a Hugging Face folder, an ``experiments.run`` workdir or a params
(orbax) checkpoint: ``glm5_jax.train.checkpoint`` reads all three (``checkpoint_config`` / ``load_params``)."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["DTYPES", "load_model", "load_serving_tokenizer"]

DTYPES = ("auto", "float32", "bfloat16")


def load_serving_tokenizer(model_path: str, tokenizer: Optional[str] = None):
    """The tokenizer named by ``tokenizer``, else ``model_path``'s tokenizer.json / *.model."""
    from glm5_jax.data.tokenizer import load_tokenizer
    if tokenizer:
        return load_tokenizer(tokenizer)
    try:
        return load_tokenizer(model_path)
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"no tokenizer at {model_path} ({e}); pass --tokenizer=PATH (a tokenizer.json or "
                                f"sentencepiece .model)") from None


def load_model(path: str, *, dtype: str = "auto", mesh=None, rules=None):
    """-> (ModelConfig, params). ``dtype`` auto: the checkpoint's own dtype (config.json's torch_dtype; a
    float32 checkpoint is served in float32), else float32 / bfloat16 for both parameters and compute.
    ``mesh`` (a Mesh or "AXIS:N,..."): each device reads its shard of the serving layout (``rules``, default
    glm5_jax.sharding.SERVE_RULES: attention replicated or over tensor, experts over expert)."""
    from glm5_jax.train.checkpoint import checkpoint_config, load_params
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: one of {', '.join(DTYPES)}")
    path = os.fspath(path)
    config = checkpoint_config(path)
    d = config.param_dtype if dtype == "auto" else dtype
    config = config.replace(param_dtype=d, dtype=d)
    from glm5_jax.sharding import SERVE_RULES, make_mesh
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    return config, load_params(path, config, mesh, SERVE_RULES if rules is None else rules)
