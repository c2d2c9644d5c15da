"""``python -m bench`` (and ``slurm-ckpt bench`` in a checkout): the engine benchmark's options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from slurm_ckpt.config import load_config, parse_size

__all__ = ["bench"]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--size", default="1G", show_default=True, help="State size (model + Adam), e.g. 8M, 1G.")
@click.option("--dir", "dir", type=click.Path(file_okay=False), default="slurm-ckpt-bench",
              show_default=True, help="Directory on the filesystem to measure (emptied of our files after).")  # fmt: skip
@click.option("--reps", default=3, show_default=True, help="Repetitions of each method, interleaved.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write all timings as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a bar chart (PNG).")
@click.option("--no-small", is_flag=True, help="Skip the 10,000-small-tensors case.")
@click.option("--sharded", is_flag=True,
              help="Instead: an FSDP2 state saved by 2 ranks and loaded at 2, 3 and 1, against dcp.save/dcp.load.")  # fmt: skip
def bench(size: str, dir: str, reps: int, json_path: str | None, plot_path: str | None, no_small: bool,
          sharded: bool) -> None:  # fmt: skip
    """Measure our saves and loads against torch.save, DCP, safetensors and the raw disk,
    and background saves' stalls against the sync save and one memcpy of the state.
    With --sharded: an FSDP2 state through the Checkpointer against dcp.save/dcp.load."""

    load_config().engine.torch_env(os.environ)  # as `slurm-ckpt run` gives its command
    if sharded:
        from .sharded import format_sharded, run_sharded_bench

        doc = run_sharded_bench(parse_size(size), Path(dir), reps=max(1, reps),
                                progress=lambda line: click.echo(line, err=True))  # fmt: skip
        click.echo(format_sharded(doc))
        if json_path:
            Path(json_path).write_text(json.dumps(doc, indent=1))
        return
    from . import format_table, plot, run_bench

    doc = run_bench(parse_size(size), Path(dir), reps=max(1, reps), small=not no_small,
                    progress=lambda line: click.echo(line, err=True))  # fmt: skip
    doc["info"]["command"] = f"python -m bench --size {size} --dir {dir} --reps {reps}" + " --no-small" * no_small
    click.echo(format_table(doc))
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    if plot_path:
        plot(doc, Path(plot_path))
