"""Draw a simulated schedule: ASCII for a terminal, SVG (hand-written) for a browser.

    Simulation.timeline (per rank: action, start, end) -> one row per rank, time left to right

A PNG is drawn only if matplotlib happens to be importable; plait does not depend on it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from xml.sax.saxutils import escape

from .actions import ActionType
from .simulator import Simulation

# Per kind, shades for a rank's 1st, 2nd, ... local stage (interleaved / V schedules).
_COLORS = {
    ActionType.F: ("#4c78a8", "#9ecae9", "#2c4a6e"),
    ActionType.B: ("#54a24b", "#a6d99c", "#2f6b29"),
    ActionType.I: ("#f58518", "#ffbf79", "#a8560a"),
    ActionType.W: ("#b279a2", "#dcb6d2", "#7a4a6e"),
}
_NAMES = {
    ActionType.F: "forward",
    ActionType.B: "backward",
    ActionType.I: "backward input",
    ActionType.W: "backward weight",
}


def _time_unit(sim: Simulation, max_cells: int) -> float:
    """The largest step that puts every start and end on a cell boundary, if few enough."""
    unit = Fraction(0)
    for rank in sim.timeline:
        for slot in rank:
            for t in (slot.start, slot.end):
                f = Fraction(t).limit_denominator(1000)
                unit = (
                    f
                    if unit == 0
                    else Fraction(
                        math.gcd(unit.numerator * f.denominator, f.numerator * unit.denominator),
                        unit.denominator * f.denominator,
                    )
                )
    unit_f = float(unit) if unit > 0 else 1.0
    return max(unit_f, sim.makespan / max_cells)


def render_ascii(sim: Simulation, *, max_cells: int = 400) -> str:
    """One row per rank; each action is its label (`1F0`) padded over its duration with
    '=', idle time is '.'. A cell is the largest time step aligning every action."""
    unit = _time_unit(sim, max_cells)
    width = 1 + max((len(str(s.action)) for r in sim.timeline for s in r), default=1)
    ncells = round(sim.makespan / unit)
    label = f"rank {sim.schedule.num_ranks - 1}"
    lines = [f"{'':<{len(label)}} | one cell = {unit:g} time unit(s); '.' = idle"]
    for r, slots in enumerate(sim.timeline):
        row = ["." * width] * ncells
        for slot in slots:
            a, b = (
                round(slot.start / unit),
                max(round(slot.end / unit), round(slot.start / unit) + 1),
            )
            text = str(slot.action)
            span = (b - a) * width - 1
            seg = (text + "=" * span)[:span] + " "
            for k in range(a, min(b, ncells)):
                row[k] = seg[(k - a) * width : (k - a + 1) * width]
        lines.append(f"{'rank ' + str(r):<{len(label)}} | " + "".join(row).rstrip())
    return "\n".join(lines)


def render_svg(sim: Simulation) -> str:
    """The timeline as a standalone SVG document (open it in any browser)."""
    sched = sim.schedule
    left, top, row_h, gap = 64, 48, 30, 4
    scale = max(4.0, min(48.0, 1400.0 / sim.makespan))
    plot_w = sim.makespan * scale
    width = int(left + plot_w + 24)
    height = int(top + sched.num_ranks * row_h + 56)
    title = (
        f"{sched.name}: {sched.num_ranks} ranks, {sched.num_stages} stages, "
        f"{sched.num_microbatches} microbatches; bubble {sim.bubble:.1%}, "
        f"makespan {sim.makespan:g}"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="13">{escape(title)}</text>',
    ]
    for r, slots in enumerate(sim.timeline):
        y = top + r * row_h
        out.append(f'<text x="8" y="{y + row_h / 2 + 4:.1f}">rank {r}</text>')
        out.append(
            f'<rect x="{left}" y="{y}" width="{plot_w:.2f}" height="{row_h - gap}" fill="#eeeeee"/>'
        )
        local = {s: i for i, s in enumerate(sched.stages_of(r))}
        for slot in slots:
            a = slot.action
            x, w = left + slot.start * scale, (slot.end - slot.start) * scale
            shades = _COLORS[a.kind]
            fill = shades[local[a.stage] % len(shades)]
            tip = f"rank {r}: {a} ({_NAMES[a.kind]}, stage {a.stage}, microbatch {a.microbatch}), t={slot.start:g}..{slot.end:g}"
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - gap}" '
                f'fill="{fill}" stroke="white" stroke-width="1"><title>{escape(tip)}</title></rect>'
            )
            text = str(a) if w >= 7 * len(str(a)) else str(a.microbatch)
            if w >= 7 * len(text):
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 2:.1f}" '
                    f'text-anchor="middle" fill="black">{escape(text)}</text>'
                )
    axis_y = top + sched.num_ranks * row_h
    step = max(1, math.ceil(sim.makespan / 20))
    for t in range(0, math.floor(sim.makespan) + 1, step):
        x = left + t * scale
        out.append(
            f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 4}" stroke="black"/>'
        )
        out.append(f'<text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">{t}</text>')
    kinds = [k for k in _COLORS if any(s.action.kind is k for r in sim.timeline for s in r)]
    for n, kind in enumerate(kinds):
        x, y = left + n * 150, axis_y + 30
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{_COLORS[kind][0]}"/>')
        out.append(f'<text x="{x + 20}" y="{y + 11}">{kind.value} {_NAMES[kind]}</text>')
    if sched.num_stages > sched.num_ranks:
        x = left + len(kinds) * 150
        out.append(
            f'<text x="{x}" y="{axis_y + 41}">lighter: a rank\'s 2nd stage (darker: 3rd)</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(sim: Simulation, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_svg(sim), encoding="utf-8")
    return path


def write_png(sim: Simulation, path: str | Path) -> Path:
    """Draw the timeline with matplotlib; raises ImportError if it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("PNG output needs matplotlib (not a plait dependency); use SVG") from e
    sched = sim.schedule
    fig, ax = plt.subplots(
        figsize=(max(6.0, min(24.0, sim.makespan / 3)), 0.6 * sched.num_ranks + 1.5)
    )
    for r, slots in enumerate(sim.timeline):
        local = {s: i for i, s in enumerate(sched.stages_of(r))}
        for slot in slots:
            a = slot.action
            shades = _COLORS[a.kind]
            ax.broken_barh(
                [(slot.start, slot.end - slot.start)],
                (r - 0.4, 0.8),
                facecolors=shades[local[a.stage] % len(shades)],
                edgecolors="white",
            )
    ax.set_yticks(range(sched.num_ranks), [f"rank {r}" for r in range(sched.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{sched.name}: bubble {sim.bubble:.1%}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
