"""Notebook 01's figure: the work of one decode step with and without a KV cache, as counted by
moekv_ref.analysis.decode_flops and as timed by time_decode_steps."""

from __future__ import annotations

from matplotlib.ticker import NullFormatter

from ..analysis import decode_flops


def plot_decode_cost(
    counted_ax, measured_ax, config, lengths: list[int], measured: dict | None = None
) -> None:
    """Left: counted MFLOP per decode step against the tokens already in the sequence. Right (if
    `measured`, {length: (recompute seconds, cached seconds)}): milliseconds per step."""
    counted_ax.plot(
        lengths, [decode_flops(config, t, False) / 1e6 for t in lengths], "o-", label="recompute (no cache)"
    )
    counted_ax.plot(lengths, [decode_flops(config, t, True) / 1e6 for t in lengths], "o-", label="cached")
    counted_ax.set(
        xlabel="tokens already in the sequence, t",
        ylabel="MFLOP per decode step",
        yscale="log",
        title="counted (decode_flops)",
    )
    counted_ax.legend(fontsize=10, loc="center right")
    if measured is None:
        return
    measured_ax.plot(lengths, [1e3 * measured[t][0] for t in lengths], "o-", label="recompute (no cache)")
    measured_ax.plot(lengths, [1e3 * measured[t][1] for t in lengths], "o-", label="cached")
    measured_ax.set(
        xlabel="tokens already in the sequence, t",
        ylabel="milliseconds per decode step",
        yscale="log",
        title="measured on this machine (best of 5 rounds)",
    )
    measured_ax.yaxis.set_minor_formatter(NullFormatter())  # a narrow log range would label every minor tick
    measured_ax.legend(fontsize=10, loc="upper left")
