"""Frozen configuration: decoding parameters, sweep grid, cells; validation of user input."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from detaudit.errors import DetauditError

TP_SIZES = (1, 2, 4, 8)
TP_MODES = ("real", "emulated")
DTYPES = ("bfloat16", "float32")
MAX_BATCH = 100_000  # batch sizes, loads and repeats past this are typos, not audits
MAX_LIMIT = 10**9  # prompts per suite (--limit)
MAX_NEW_TOKENS = 1 << 20  # generated tokens per prompt: more than any model's context
MAX_SEED = 2**63 - 1  # seeds are non-negative 64-bit integers, as every engine and server takes them
MAX_TOP_K = 2**31 - 1  # an int32 in every engine and server API
MAX_LOGPROBS = 20  # OpenAI-compatible APIs and vLLM return at most 20 top log-probabilities per position
# cells one grid (a sweep's, or the one a manifest declares) may hold: 4 TP sizes x 3 backends x 3 batch sizes
# is 36 a suite; past this it is a typo or a hostile manifest, whose readers would list every cell
MAX_GRID_CELLS = 10_000
DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]{1,2})?")
# vLLM raises smaller temperatures to 0.01 (the engines would sample differently), and logits / T
# overflows to inf (NaN probabilities) as T nears 0: a temperature below it is refused; 0 is greedy
MIN_TEMPERATURE = 0.01


def check_tp_size(tp: int, option: str = "--tp") -> None:
    if tp not in TP_SIZES:
        raise DetauditError(f"{option} {tp}: TP size must be one of 1, 2, 4, 8 (a power of two <= 8)")


def check_limit(limit: int | None) -> None:
    if limit is not None and not 1 <= limit <= MAX_LIMIT:
        raise DetauditError(f"--limit must be between 1 and {MAX_LIMIT} (got {limit})")


def check_grid_size(*axes: object) -> int:
    """The number of cells of a grid of these axes (sized lists), refused past MAX_GRID_CELLS."""
    n = math.prod(len(a) for a in axes)  # type: ignore[arg-type]
    if n > MAX_GRID_CELLS:
        raise DetauditError(
            f"the grid has {n} cells (suites x backends x TP sizes x batch sizes x background loads x "
            "speculative settings); "
            f"detaudit runs at most MAX_GRID_CELLS = {MAX_GRID_CELLS}"
        )
    return n


def check_device(device: object, option: str = "--device") -> str:
    if not isinstance(device, str) or not DEVICE_RE.fullmatch(device):
        raise DetauditError(f"{option} {str(device)[:40]!r}: must be cpu or cuda (or cuda:N)")
    return device


@dataclass(frozen=True)
class DecodingParams:
    """Published setup by default (TBIK paper, Qwen3): T=0.6, top-p 0.95, top-k 20, seed 42."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 64
    seed: int = 42
    greedy: bool = False
    logprobs: int = 10  # top-k log-probabilities recorded per position (>= 5)
    stop: tuple[str, ...] = ()  # stop strings (a suite's `generation_kwargs.until`: detaudit.decoding)

    def __post_init__(self) -> None:
        """Every field is checked, greedy or not: all of them are recorded in the manifest (which must stay
        strict JSON: no NaN) and sent to engines and servers."""
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise DetauditError(f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS} (got {self.max_new_tokens})")
        if self.logprobs < 5:
            raise DetauditError(f"--logprobs must be >= 5 (got {self.logprobs})")
        if self.logprobs > MAX_LOGPROBS:
            raise DetauditError(
                f"--logprobs must be <= {MAX_LOGPROBS} (got {self.logprobs}; the most vLLM and OpenAI-compatible "
                "servers return; the metrics read the top 5)"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise DetauditError(f"--seed must be between 0 and 2**63 - 1 (got {str(self.seed)[:40]})")
        if not 0 <= self.temperature < 1e300:  # NaN, inf and a 600-digit int fail too
            raise DetauditError(
                f"--temperature must be >= 0 and finite (got {str(self.temperature)[:40]}; 0 decodes greedily)"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise DetauditError(
                f"--temperature {self.temperature}: must be 0 (greedy) or >= {MIN_TEMPERATURE} "
                "(vLLM raises smaller ones to it; near 0 the scaled logits overflow)"
            )
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise DetauditError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise DetauditError(
                f"--top-k must be between 0 and {MAX_TOP_K} (got {str(self.top_k)[:40]}; 0 disables it)"
            )
        if self.temperature == 0 and not self.greedy:  # as OpenAI-style APIs define it
            object.__setattr__(self, "greedy", True)
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise DetauditError(f"stop strings must be non-empty strings (got {list(self.stop)!r:.80})")

    def to_dict(self) -> dict:
        """`stop` only when set: runs without stop strings keep the identity they always had."""
        d = asdict(self)
        if not self.stop:
            d.pop("stop")
        else:
            d["stop"] = list(self.stop)
        return d


def request_seed(seed: int, prompt_id: str) -> int:
    """The per-request sampling seed every engine uses (built-in generator, vLLM, servers): it depends
    on the run's seed and the prompt id only, never on the batch the request lands in."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:8], "little") & (2**63 - 1)


SPEC_KINDS = ("off", "ngram", "draft")
MAX_SPEC_K = 16  # drafted tokens per step: more is a typo (every verify step runs k + 1 rows per request)
NGRAM_MAX = 5  # n-gram drafts: the longest suffix of the context looked up (prompt lookup), down to 1 token


@dataclass(frozen=True)
class Speculative:
    """One value of the speculative-decoding axis (`--speculative`): `off`, `ngram:K` (prompt lookup: the
    K tokens that followed the first occurrence of the context's longest recurring suffix of up to
    NGRAM_MAX tokens) or `draft:MODEL:K` (a draft model's K greedy tokens; MODEL a checkpoint directory
    or a named model sharing the target's tokenizer). `model`: the draft's resolved checkpoint, set by
    the sweep before any engine opens (`with_model`)."""

    kind: str = "off"
    k: int = 0
    draft: str = ""  # the draft model as given (kind "draft" only)
    model: ModelRef | None = field(default=None, compare=False)

    @property
    def on(self) -> bool:
        return self.kind != "off"

    @property
    def label(self) -> str:
        """The cell-id coordinate: "" (off: ids as before the axis existed), `ngramK`, `draftK-NAME` (NAME:
        the draft's directory or model name, made file-name safe)."""
        if self.kind == "off":
            return ""
        if self.kind == "ngram":
            return f"ngram{self.k}"
        return f"draft{self.k}-{draft_name(self.draft)}"

    def __str__(self) -> str:
        return {"off": "off", "ngram": f"ngram:{self.k}"}.get(self.kind) or f"draft:{self.draft}:{self.k}"

    def describe(self) -> dict:
        """What the manifest records of this setting (the draft's identity included)."""
        d: dict = {"setting": str(self), "kind": self.kind, "k": self.k}
        if self.kind == "ngram":
            d["ngram_max"] = NGRAM_MAX
        if self.model is not None:
            d.update(draft=self.draft, name=self.model.name, path=str(self.model.path), checksum=self.model.checksum)
        return d


def draft_name(spec: str) -> str:
    """A draft model's name in cell ids: its directory's (or named model's) last path part, with every
    character outside [A-Za-z0-9.-] replaced by '-', at most 48 characters, starting and ending with a
    letter or digit ("draft" when none is left)."""
    base = re.sub(r"[^A-Za-z0-9.-]", "-", Path(str(spec).rstrip("/")).name or str(spec)).strip("-.")[:48]
    return base or "draft"


def parse_speculative(text: str, option: str = "--speculative") -> Speculative:
    """`off`, `ngram:K` or `draft:MODEL:K` (1 <= K <= MAX_SPEC_K), refused in one line otherwise."""
    t = str(text).strip()
    if t == "off":
        return Speculative()
    kind, _, rest = t.partition(":")
    model, _, k_text = rest.rpartition(":") if kind == "draft" else ("", "", rest)
    if kind not in SPEC_KINDS[1:]:
        raise DetauditError(f"{option} {t[:60]!r}: unknown kind {kind[:20]!r} (expected off, ngram:K or draft:MODEL:K)")
    if kind == "draft" and not model:
        raise DetauditError(f"{option} {t[:60]!r}: expected draft:MODEL:K (MODEL a directory or a named model)")
    if not re.fullmatch(r"[0-9]{1,3}", k_text) or not 1 <= int(k_text) <= MAX_SPEC_K:
        raise DetauditError(
            f"{option} {t[:60]!r}: K (drafted tokens per step) must be an integer between 1 and {MAX_SPEC_K}"
        )
    return Speculative(kind, int(k_text), model)


def parse_speculative_list(text: str, option: str = "--speculative") -> tuple[str, ...]:
    """The axis as given: comma-separated settings, each valid, none twice, no two drafts of one name."""
    values = parse_str_list(text, option)
    check_speculative(values, option)
    return values


def check_speculative(values: tuple[str, ...], option: str = "--speculative") -> tuple[Speculative, ...]:
    specs = tuple(parse_speculative(v, option) for v in values)
    labels = [s.label for s in specs]
    twice = sorted({str(s) for s, lab in zip(specs, labels) if labels.count(lab) > 1})
    if twice:
        raise DetauditError(
            f"{option} lists one setting twice, or two draft models of one name ({', '.join(twice)[:120]}): "
            "cell ids would clash"
        )
    return specs


@dataclass(frozen=True)
class Cell:
    backend: str
    tp: int
    batch_size: int
    suite: str
    background: int = 0  # server engines: concurrent background requests while this cell runs
    speculative: str = ""  # the speculative setting's label (`Speculative.label`; "" = off)

    @property
    def id(self) -> str:
        """`suite__backend__tpN__bsN[__SPEC][__bgN]` (cell ids become file names: only [A-Za-z0-9_.-])."""
        safe_backend = re.sub(r"[^A-Za-z0-9_.-]", "-", self.backend)
        spec = f"__{self.speculative}" if self.speculative else ""
        bg = f"__bg{self.background}" if self.background else ""
        return f"{self.suite}__{safe_backend}__tp{self.tp}__bs{self.batch_size}{spec}{bg}"

    @classmethod
    def recorded(cls, cell_id: str, backend: str, tp: int, batch_size: int, suite: str) -> "Cell":
        """The cell a manifest records under `cell_id` (its load read from the id's `__bgN`, its
        speculative setting from `__ngramK` / `__draftK-NAME`): it is that cell only if its `id` gives
        `cell_id` back, which `Manifest.from_dict` requires."""
        return cls(backend, tp, batch_size, suite, background_of(cell_id), speculative_of(cell_id))

    @property
    def describe_key(self) -> str:
        """The manifest's `backends` key of this cell's own engine description (engines that describe
        each cell: vLLM's batch size, a server's load)."""
        key = describe_key(self.backend, self.tp, self.batch_size, self.background)
        return key + (f"@{self.speculative}" if self.speculative else "")


def background_of(cell_id: str) -> int:
    """The background load a cell id records (`__bgN`; 0 without)."""
    bg = re.search(r"__bg([0-9]{1,7})$", cell_id)
    return int(bg.group(1)) if bg else 0


_SPEC_ID_RE = re.compile(r"__((?:ngram|draft)[0-9]{1,3}(?:-[A-Za-z0-9.-]{1,48})?)(?:__bg[0-9]{1,7})?$")


def speculative_of(cell_id: str) -> str:
    """The speculative label a cell id records (`__ngramK`, `__draftK-NAME`; "" without)."""
    spec = _SPEC_ID_RE.search(cell_id)
    return spec.group(1) if spec else ""


def plain_cell_id(cell_id: str) -> str:
    """The id of the cell with the same coordinates but speculative decoding off (the id itself when off)."""
    spec = _SPEC_ID_RE.search(cell_id)
    return cell_id if spec is None else cell_id[: spec.start(1) - 2] + cell_id[spec.end(1) :]


def describe_key(backend: object, tp: object, batch_size: object, background: int) -> str:
    return f"{backend}@tp{tp}@bs{batch_size}" + (f"@bg{background}" if background else "")


SERVER_APIS = ("completions", "chat")
PROMPT_FORMATS = ("ids", "text")
SERVER_KINDS = ("auto", "vllm", "sglang", "generic")
BACKGROUND_PROMPTS = ("suite", "random", "mixed", "prefix")  # load patterns (server/load.py)


@dataclass(frozen=True)
class ServerConfig:
    """The server engines' options as given on the command line. No secret: the API key is read, at
    request time, from the environment variable `api_key_env` names."""

    base_url: str | None = None
    api: str = "completions"
    prompt_format: str = "ids"
    api_key_env: str | None = None
    server_model: str | None = None  # the id to request; default: the one matching --model
    server_kind: str = "auto"
    background_prompts: str = "suite"
    request_timeout: float = 300.0

    def __post_init__(self) -> None:
        for option, value, allowed in (
            ("--api", self.api, SERVER_APIS),
            ("--prompt-format", self.prompt_format, PROMPT_FORMATS),
            ("--server-kind", self.server_kind, SERVER_KINDS),
            ("--background-prompts", self.background_prompts, BACKGROUND_PROMPTS),
        ):
            if value not in allowed:
                raise DetauditError(f"{option} {value}: must be one of {', '.join(allowed)}")
        if not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise DetauditError(f"--request-timeout must be > 0 seconds (got {self.request_timeout})")


@dataclass(frozen=True)
class EngineSettings:
    """The run-wide engine knobs, carried whole from the command line to the engine (into every worker
    process): a new knob is one field here and its one consumer."""

    name: str = "builtin"
    dtype: str = "bfloat16"
    device: str = "cpu"
    cuda_graphs: bool = True  # built-in engine on a GPU: decode steps replayed from CUDA graphs
    hang_timeout: float = 300.0  # seconds without progress before a worker is declared hung
    server: ServerConfig | None = None  # server engines only

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise DetauditError(f"--dtype {self.dtype}: must be one of {', '.join(DTYPES)}")
        check_device(self.device)
        if not (math.isfinite(self.hang_timeout) and self.hang_timeout > 0):
            raise DetauditError(f"--hang-timeout must be > 0 seconds (got {self.hang_timeout})")

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class ModelRef:
    """A resolved checkpoint (`models.resolve_model`): its config.json is read there, once."""

    name: str
    path: Path
    architecture: str
    checksum: str  # sha256 over the per-file sha256s
    config: dict = field(default_factory=dict, compare=False, hash=False)  # config.json as read
    spec: str = ""  # --model as given (a server engine matches the served model id against it)


@dataclass(frozen=True)
class EngineOptions:
    """What opening one (backend, TP) group's engine needs, in one piece: built once by the driver,
    passed whole to the engine (and pickled to its worker processes)."""

    settings: EngineSettings
    model: ModelRef
    backend: str
    tp: int = 1
    tp_mode: str = "real"  # how this group runs TP (TP 1 is always real)
    eos_ids: tuple[int, ...] = ()
    max_batch_size: int = 0  # the group's largest batch (engines that size themselves once)
    max_background: int = 0  # server engines: the largest background load of the grid
    log_dir: Path | None = None  # where an engine keeps logs of processes it starts
    multi_node: bool = False  # the engine places its own TP ranks on a Ray cluster (set by the executor)
    trace_dir: Path | None = None  # vLLM: its workers' profiler traces (`generate(profile=True)`), set by bench vllm

    @property
    def emulated(self) -> bool:
        return self.tp_mode == "emulated" and self.tp > 1


@dataclass(frozen=True)
class SweepConfig:
    model: str
    suites: tuple[str, ...]
    backends: tuple[str, ...] = ("bf16", "bio", "bio+tbik")
    tp: tuple[int, ...] = (1, 2, 4, 8)
    batch_sizes: tuple[int, ...] = (8, 16, 32)
    decoding: DecodingParams = field(default_factory=DecodingParams)
    limit: int | None = None
    tp_mode: str = "real"
    engine: EngineSettings = field(default_factory=EngineSettings)
    executor: str = "local"
    background_load: tuple[int, ...] = (0,)  # server engines: background requests per cell (a grid axis)
    repeats: int = 1  # server engines: every prompt is sent this many times per cell
    speculative: tuple[str, ...] = ("off",)  # speculative-decoding settings (a grid axis: `Speculative`)
    # the DecodingParams fields given on the command line: they win over a suite's generation_kwargs
    decoding_flags: tuple[str, ...] = ()
    apply_chat_template: bool | None = None  # None: each suite's own default (detaudit.inputs.suites)
    trust_suite_paths: bool = False  # suite files may read files outside their own directory

    def __post_init__(self) -> None:
        if not self.suites:
            raise DetauditError("no suite given (--suites)")
        if not self.backends:
            raise DetauditError("no backend given (--backends)")
        for tp in self.tp:
            check_tp_size(tp)
        for bs in self.batch_sizes:
            if not 1 <= bs <= MAX_BATCH:
                raise DetauditError(f"--batch-sizes {bs}: batch size must be between 1 and {MAX_BATCH}")
        check_limit(self.limit)
        if not 1 <= self.repeats <= MAX_BATCH:
            raise DetauditError(f"--repeats must be between 1 and {MAX_BATCH} (got {self.repeats})")
        for bg in self.background_load:
            if not 0 <= bg <= MAX_BATCH:
                raise DetauditError(f"--background-load {bg}: must be between 0 and {MAX_BATCH}")
        if self.tp_mode not in TP_MODES:
            raise DetauditError(f"--tp-mode {self.tp_mode}: must be one of {', '.join(TP_MODES)}")
        if not self.speculative:
            raise DetauditError("--speculative is empty (off is the plain decoding)")
        check_speculative(tuple(self.speculative))
        check_grid_size(self.suites, self.backends, self.tp, self.batch_sizes, self.background_load, self.speculative)
        for name, values in (
            ("--backends", self.backends),
            ("--tp", self.tp),
            ("--batch-sizes", self.batch_sizes),
            ("--suites", self.suites),
            ("--background-load", self.background_load),
        ):
            if len(set(values)) != len(values):
                raise DetauditError(f"{name} lists a value twice: {', '.join(map(str, values))}")

    def cells(self) -> list[Cell]:
        """Grid order: backend, TP, then suite, batch size and speculative setting, so one engine per
        (backend, TP) serves consecutive cells."""
        labels = [s.label for s in self.speculative_settings()]
        return [
            Cell(b, tp, bs, s, bg, spec)
            for b in self.backends
            for tp in self.tp
            for s in self.suites
            for bs in self.batch_sizes
            for spec in labels
            for bg in self.background_load
        ]

    def speculative_settings(self) -> tuple[Speculative, ...]:
        return check_speculative(tuple(self.speculative))

    def setting_of(self, cell: Cell) -> Speculative:
        """The setting a cell of this grid runs (its label names it)."""
        return next(s for s in self.speculative_settings() if s.label == cell.speculative)

    def to_dict(self) -> dict:
        """The manifest's `config`: the engine settings flattened to the keys runs have always recorded
        (`engine` is the engine's name)."""
        d = asdict(self)
        engine = d.pop("engine")
        d.update(engine=engine.pop("name"), **engine)
        d["server"] = d["server"] or {}
        d["decoding"] = self.decoding.to_dict()
        return d

    def tp_mode_of(self, tp: int) -> str:
        """How a cell of this TP size runs: TP 1 is always real."""
        return "emulated" if (self.tp_mode == "emulated" and tp > 1) else "real"

    def reference(self, cell: Cell) -> Cell:
        """Teacher forcing: every cell of a (backend, suite) scores the first such cell's outputs."""
        return next(c for c in self.cells() if c.backend == cell.backend and c.suite == cell.suite)


INT_RE = re.compile(r"-?[0-9]{1,30}")  # ASCII digits only (int() also takes "1_0" and other scripts' digits)


def parse_str_list(text: str, option: str) -> tuple[str, ...]:
    """Comma-separated values, each stripped; an empty item (`a,,b`, a trailing comma) is a typo, refused."""
    values = tuple(x.strip() for x in str(text).split(","))
    if not any(values):
        raise DetauditError(f"{option} is empty")
    if not all(values):
        raise DetauditError(f"{option} {str(text)[:60]!r}: an item of the comma-separated list is empty")
    return values


def parse_int_list(text: str, option: str, lo: int | None = None, hi: int | None = None) -> tuple[int, ...]:
    """Comma-separated integers, each within [lo, hi] when given."""
    items = parse_str_list(text, option)
    bad = next((x for x in items if not INT_RE.fullmatch(x)), None)
    if bad is not None:
        raise DetauditError(f"{option} expects comma-separated integers (got {str(text)[:60]!r})")
    values = tuple(int(x) for x in items)
    for v in values:
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}" if lo else f"<= {hi}"
            raise DetauditError(f"{option} {v}: must be {want}")
    return values
