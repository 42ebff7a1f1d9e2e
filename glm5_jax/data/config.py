"""`DataConfig`: every knob of the LM data pipeline, validated at construction.

Data: `path` (None = the *.py sources of the running Python's standard library) is a glob, a file, a
directory or a comma-separated list of them; each file's format comes from its extension (see
glm5_jax.data.sources). `tokenizer` is None / "spm" (a sentencepiece BPE trained here on the train
split), "hf" (a byte-level BPE tokenizer.json trained here) or the path of a sentencepiece `.model` or a
Hugging Face `tokenizer.json`.

All sizes are validated eagerly so that a bad value fails with a ConfigError naming the field,
the value and what is allowed, instead of failing deep inside sentencepiece or grain. Every field
can be set from the command line of an experiment (`--set data.max_files=50`, `data.cache_dir=none`,
`data.exclude_dirs=test,tests`, `data.path=corpus/*.jsonl.gz`, `data.tokenizer=glm5/tokenizer.json`).

Mixtures: `sources` names several data sets, each with a weight (glm5_jax.data.mixture):
`--set data.sources=web=corpus/web:0.6,code=data/prep_code:0.4` (`[NAME=]PATH[:WEIGHT]`, comma-separated;
NAME defaults to the file name without extension, WEIGHT to 1; weights are normalised) or JSON,
`--set 'data.sources=[{"name": "web", "path": "a.jsonl,b.jsonl", "weight": 0.6}, ...]'` (a path that holds
commas or ends in `:<number>`). A mix (`parse_mix`, e.g. a stage's `Stage.data`) re-weights the sources by
name: `web:0.2,code:0.8`; a source it leaves out is not read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping, Optional, Tuple

from glm5_jax.errors import ConfigError
from glm5_jax.fields import check_fields, invalid, setting

# Directory names skipped anywhere below the stdlib root (test suites and third-party code).
DEFAULT_EXCLUDE_DIRS: Tuple[str, ...] = (
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
)

CACHE_ENV_VAR = "GLM5_JAX_DATA_CACHE"
# token ids are stored uint32 above 2**16, so any vocabulary up to this trains and packs
MAX_VOCAB = 1 << 24
TRAINED_TOKENIZERS = ("spm", "hf")


def default_cache_dir() -> str:
    """`$GLM5_JAX_DATA_CACHE` if set, else `~/.cache/glm5_jax/data`."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "glm5_jax", "data")


_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_NUMBER = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|nan|inf)", re.IGNORECASE)
SOURCES_SYNTAX = ("a comma list of [NAME=]PATH[:WEIGHT] (e.g. web=corpus/web:0.6,code=data/prep:0.4) or a JSON "
                  "list of {\"name\", \"path\", \"weight\"} objects")
MIX_SYNTAX = "a comma list of NAME:WEIGHT over the source names (e.g. web:0.2,code:0.8)"


@dataclasses.dataclass(frozen=True)
class MixSource:
    """One source of a mixture: `path` (as DataConfig.path: files, globs, a prepared directory) read with
    the mixture's tokenizer, drawn with probability weight / sum(weights)."""
    name: str
    path: str
    weight: float = 1.0

    def __str__(self) -> str:
        return f"{self.name}={self.path}:{self.weight:g}"


def _weight(field: str, value, where: str) -> float:
    try:
        w = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        w = math.nan
    if not (math.isfinite(w) and w > 0):
        raise ConfigError(f"DataConfig.{field}: {where}: weight {value!r} is invalid; allowed: a finite number > 0 "
                          "(a source that should not be read is left out of the mix)")
    return w


def _source_from(item, i: int) -> MixSource:
    if isinstance(item, MixSource):
        return item
    if isinstance(item, Mapping):
        unknown = sorted(set(item) - {"name", "path", "weight"})
        if unknown or "path" not in item:
            raise _bad("sources", item, f"source {i}: an object with 'path' and optional 'name', 'weight' "
                       f"(unknown keys {unknown})" if unknown else f"source {i}: 'path' is missing")
        name, path, weight = item.get("name"), item["path"], item.get("weight", 1.0)
    elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
        name, path, weight = (item[0], item[1], item[2]) if len(item) == 3 else (item[0], item[1], 1.0)
    elif isinstance(item, str):
        text = item.strip()
        name, _, rest = text.partition("=")
        if not (_ and _NAME.fullmatch(name.strip())):       # no NAME= prefix ("=" may be in the path)
            name, rest = None, text
        path, weight = rest, 1.0
        head, sep, tail = rest.rpartition(":")
        if sep and _NUMBER.fullmatch(tail.strip()):
            path, weight = head, tail
    else:
        raise _bad("sources", item, f"source {i}: {SOURCES_SYNTAX}")
    if not (isinstance(path, str) and path.strip()):
        raise _bad("sources", item, f"source {i}: the path is empty")
    path = path.strip()
    if name is None or (isinstance(name, str) and not name.strip()):
        base = os.path.basename(path.rstrip("/").split(",")[0])
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", base.split(".")[0]) or f"source{i}"
    if not (isinstance(name, str) and _NAME.fullmatch(name.strip())):
        raise _bad("sources", item, f"source {i}: name {name!r} must be letters, digits, '_', '.', '-'")
    return MixSource(name.strip(), path, _weight("sources", weight, f"source {i} ({name.strip()})"))


def parse_sources(value) -> Tuple[MixSource, ...]:
    """`DataConfig.sources` from its command-line string (`[NAME=]PATH[:WEIGHT],...` or JSON), a list of
    dicts / (name, path[, weight]) tuples / MixSource; () for none. ConfigError naming what is wrong."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return ()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise _bad("sources", value, f"{SOURCES_SYNTAX} (invalid JSON: {e})") from None
        else:
            value = [x for x in text.split(",") if x.strip()]
    if isinstance(value, Mapping) or not isinstance(value, (tuple, list)):
        raise _bad("sources", value, SOURCES_SYNTAX)
    out = tuple(_source_from(x, i) for i, x in enumerate(value))
    names = [s.name for s in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _bad("sources", value, f"distinct source names; {dup} repeat (name them: NAME=PATH:WEIGHT)")
    return out


def parse_mix(spec, names) -> Tuple[Tuple[str, float], ...]:
    """A mix over the sources `names`: ((name, weight), ...) in `names` order, from `NAME:WEIGHT,...`, a
    {name: weight} mapping or pairs. A source left out is not drawn; ConfigError for an unknown name, a
    repeated one or a weight that is not a finite number > 0."""
    names = tuple(names)
    if isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, sep, w = part.rpartition(":")
            if not sep or not name.strip():
                raise _bad("mix", spec, f"{MIX_SYNTAX}; {part!r} has no NAME:WEIGHT form")
            items.append((name.strip(), w.strip()))
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) == 2 for x in spec):
        items = [tuple(x) for x in spec]
    else:
        raise _bad("mix", spec, MIX_SYNTAX)
    if not items:
        raise _bad("mix", spec, f"{MIX_SYNTAX}: at least one source")
    seen = {}
    for name, w in items:
        if name not in names:
            raise _bad("mix", spec, f"{MIX_SYNTAX}; {name!r} is not a source (sources: {', '.join(names)})")
        if name in seen:
            raise _bad("mix", spec, f"{MIX_SYNTAX}; {name!r} is given twice")
        seen[name] = _weight("mix", w, f"source {name}")
    return tuple((n, seen[n]) for n in names if n in seen)


def _bad(field: str, value, allowed: str) -> ConfigError:
    # the one message form of every config (glm5_jax.fields.invalid), a ConfigError like ModelConfig's / TrainConfig's
    return invalid("DataConfig", field, value, f"allowed: {allowed}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Configuration of corpus, tokenizer, packing and retrieval mixing.

    Fields:
      vocab_size: the model's vocabulary: the size of a tokenizer trained here (sentencepiece: 3
        control ids + 21 GLM specials + 256 byte pieces + merges; "hf": 22 specials + 256 bytes +
        merges); a loaded tokenizer must have vocab_size <= this (the rest pads the embedding).
      path: the data (None -> stdlib *.py sources); glob / file / directory / prepared directory,
        comma-separated for several.
      tokenizer: None or "spm" (train sentencepiece here), "hf" (train a tokenizer.json here), or a
        tokenizer path (sentencepiece .model, tokenizer.json, or a directory holding one).
      text_field / messages_field: the jsonl / parquet / ArrayRecord-JSON field holding a document's
        text, or (if text_field is absent) its chat messages.
      seq_len: default packed sequence length T (batches are [B, T]).
      cache_dir: root of the on-disk caches (None -> `default_cache_dir()`).
      max_files: keep only the first N corpus files (sorted by relative path); None = all.
      max_bytes: stop adding files once this many bytes were collected; None = no cap.
      eval_fraction: fraction of files (by hash of relative path) held out for eval.
      seed: default shuffle / retrieval seed.
      retrieval_fraction: fraction of train sequences replaced by synthetic retrieval ones.
      retrieval_pairs: key/value pairs planted per retrieval sequence (every probe holds this many).
      retrieval_min_pairs: None, or train retrieval sequences hold a record count drawn uniformly
        from [retrieval_min_pairs, retrieval_pairs] (glm5_jax/data/retrieval.py says why).
      retrieval_min_distance: the query starts more than this many positions after the end
        of the queried pair (None -> seq_len // 2).
      retrieval_key_digits: key space = min(10**retrieval_key_digits, 52) one-token letter keys;
      retrieval_value_digits: digits per value (one token each).
      tokenizer_train_bytes: cap of training-split text fed to the tokenizer trainer.
      stdlib_root: corpus root override (None -> sysconfig stdlib).
      exclude_dirs: directory names skipped when walking the corpus root.
      sources: () (train on `path`), or a weighted mixture of sources (MixSource; from the command
        line `NAME=PATH:WEIGHT,...` or JSON: module docstring); `path` must then be None. Every source
        shares the tokenizer and the other settings here; each keeps its own held-out split.
    """

    vocab_size: int = setting(2048, integer=True, min=320, max=MAX_VOCAB)
    seq_len: int = setting(256, integer=True, min=2, max=1 << 20)
    path: Optional[str] = None
    tokenizer: Optional[str] = None
    text_field: str = "text"
    messages_field: str = "messages"
    cache_dir: Optional[str] = None
    max_files: Optional[int] = setting(None, integer=True, min=2, optional=True)
    max_bytes: Optional[int] = setting(None, integer=True, min=1, optional=True)
    eval_fraction: float = setting(0.02, gt=0, lt=0.5)
    seed: int = setting(0, integer=True, min=0, lt=2**32)
    retrieval_fraction: float = setting(0.0, min=0, lt=1)
    retrieval_pairs: int = setting(4, integer=True, min=1, max=4096)
    retrieval_min_pairs: Optional[int] = None
    retrieval_min_distance: Optional[int] = setting(None, integer=True, min=0, optional=True)
    retrieval_key_digits: int = setting(3, integer=True, min=1, max=6)
    retrieval_value_digits: int = setting(3, integer=True, min=1, max=6)
    tokenizer_train_bytes: int = setting(8_000_000, integer=True, min=10_000)
    stdlib_root: Optional[str] = None
    exclude_dirs: Tuple[str, ...] = DEFAULT_EXCLUDE_DIRS
    sources: Any = ()

    def __post_init__(self):
        object.__setattr__(self, "sources", parse_sources(self.sources))
        if self.sources and self.path is not None:
            raise _bad("path", self.path, f"None when data.sources is set (sources: "
                       f"{', '.join(map(str, self.sources))}); put this path in data.sources")
        if self.sources and self.retrieval_fraction:
            raise _bad("retrieval_fraction", self.retrieval_fraction,
                       "0 when data.sources is set (the retrieval probe is built from one corpus)")
        check_fields(self)
        for f in ("path", "tokenizer"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, str) and v.strip()):
                raise _bad(f, v, "None or a non-empty string")
        for f in ("text_field", "messages_field"):
            v = getattr(self, f)
            if not (isinstance(v, str) and v):
                raise _bad(f, v, "a non-empty field name")
        if self.cache_dir is not None and not (isinstance(self.cache_dir, str) and self.cache_dir):
            raise _bad("cache_dir", self.cache_dir, "None or a non-empty path string")
        if self.retrieval_min_pairs is not None and (
            not _is_int(self.retrieval_min_pairs) or not (1 <= self.retrieval_min_pairs <= self.retrieval_pairs)
        ):
            raise _bad("retrieval_min_pairs", self.retrieval_min_pairs,
                       f"None or int in [1, retrieval_pairs={self.retrieval_pairs}]")
        if self.retrieval_pairs > 10**self.retrieval_key_digits:
            raise _bad(
                "retrieval_pairs",
                self.retrieval_pairs,
                f"<= 10**retrieval_key_digits = {10**self.retrieval_key_digits} (keys are distinct)",
            )
        if self.stdlib_root is not None and not (
            isinstance(self.stdlib_root, str) and os.path.isdir(self.stdlib_root)
        ):
            raise _bad("stdlib_root", self.stdlib_root, "None or an existing directory")
        if not isinstance(self.exclude_dirs, tuple) or not all(
            isinstance(d, str) and d for d in self.exclude_dirs
        ):
            raise _bad("exclude_dirs", self.exclude_dirs, "tuple of non-empty directory names")

    @property
    def tokenizer_kind(self) -> str:
        """"spm" / "hf" (trained here) or "path" (loaded from `tokenizer`)."""
        if self.tokenizer is None:
            return "spm"
        return self.tokenizer if self.tokenizer in TRAINED_TOKENIZERS else "path"

    def resolved_cache_dir(self) -> str:
        return self.cache_dir if self.cache_dir is not None else default_cache_dir()

    def min_distance(self, seq_len: int) -> int:
        if self.retrieval_min_distance is not None:
            return self.retrieval_min_distance
        return seq_len // 2
