"""`detaudit align`: rollout-vs-trainer alignment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from detaudit.cli.common import (
    ALL_BACKENDS,
    DEFAULT_MODEL,
    SAMPLING,
    BackendsOpt,
    DataDirOpt,
    DeviceOpt,
    Dtype,
    DtypeOpt,
    JsonOpt,
    LimitOpt,
    MaxNewTokensOpt,
    ModelOpt,
    SeedOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    TpMode,
    TpModeOpt,
    command_line,
    decoding,
    err,
    handle_errors,
    out,
    out_path,
    print_json,
    print_rows,
)


@handle_errors
def align(
    rollout: Annotated[
        str, typer.Option("--rollout", help="ENGINE:TP that samples the rollouts (KV-cache decode).")
    ] = "builtin:4",
    trainer: Annotated[
        str, typer.Option("--trainer", help="ENGINE:TP that re-scores them (one full forward per sequence).")
    ] = "builtin:1",
    backends: BackendsOpt = ALL_BACKENDS,
    model: ModelOpt = DEFAULT_MODEL,
    suite: Annotated[str, typer.Option("--suite", help="Suite name or lm-eval task YAML path.")] = "smoke",
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    max_new_tokens: MaxNewTokensOpt = 64,
    temperature: TemperatureOpt = SAMPLING.temperature,
    top_p: TopPOpt = SAMPLING.top_p,
    top_k: TopKOpt = SAMPLING.top_k,
    seed: SeedOpt = SAMPLING.seed,
    tp_mode: TpModeOpt = TpMode.real,
    dtype: DtypeOpt = Dtype.bfloat16,
    device: DeviceOpt = "cpu",
    output_path: Annotated[
        Path, typer.Option("--output-path", "-o", parser=out_path, metavar="DIR", help="Directory to write.")
    ] = Path("runs/align"),
    json_: JsonOpt = False,
):
    """Rollout-vs-trainer audit: do the trainer's probabilities of the sampled tokens match the rollout's?"""
    from detaudit import paths
    from detaudit.align import AlignConfig, Side, shown_columns
    from detaudit.align import align as run
    from detaudit.analysis.metrics import routing_legend
    from detaudit.config import parse_str_list

    cfg = AlignConfig(
        rollout=Side.parse(rollout, "--rollout"),
        trainer=Side.parse(trainer, "--trainer"),
        backends=parse_str_list(backends, "--backends"),
        model=model,
        suite=suite,
        limit=limit,
        decoding=decoding(temperature, top_p, top_k, seed, max_new_tokens),
        batch_size=batch_size,
        tp_mode=tp_mode.value,
        dtype=dtype.value,
        device=device,
    )
    summary, files = run(cfg, output_path, data_dir=paths.data_dir(data_dir), command=command_line(), console=err)
    if json_:
        print_json(summary.to_dict(orient="records"))
    else:
        rows = [
            {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()}
            for r in summary.to_dict(orient="records")
        ]
        title = f"alignment: rollout {cfg.rollout} vs trainer {cfg.trainer}"
        print_rows(rows, shown_columns(summary), title=title)  # routing columns where some backend has them
        for line in routing_legend(shown_columns(summary)):
            out.print(Text(line, style="dim"))
    err.print("wrote " + ", ".join(str(f) for f in files))
