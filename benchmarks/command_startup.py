"""Benchmark: what loading a tokenizer costs a command at start (issue 16; tests' start-up).

Run it from the repository root::

    .venv/bin/python benchmarks/command_startup.py           # 10 rounds
    .venv/bin/python benchmarks/command_startup.py --quick   # 4 rounds

What it measures
----------------
Each phase is a fresh interpreter (as a command starts) that imports what a command imports
and exits; its CPU (user + system, from ``os.wait4``) and its peak RSS (``VmHWM``, read by the
interpreter itself before it exits) are recorded, and whether torch got loaded:

- ``inspect``: ``turnstream.inspect.command`` and its tokenizer (``_tokenizer``, through
  ``gateway.templates.load_tokenizer``: for a directory that names the plain fast tokenizer,
  that class directly); ``inspect_before``: the same command module and
  ``transformers.AutoTokenizer.from_pretrained`` on the same directory, as it loaded it before
  (AutoTokenizer's module imports torch);
- ``supervisor``: ``turnstream.services.gateway.command``, what the ``--workers N`` supervisor
  loads;
  ``supervisor_before``: that, transformers' AutoTokenizer and the local backend, which it
  imported before (torch with them).

The phases alternate within each round, the order reversed every other round; medians over
the rounds. The LAST line is one JSON object: ``<phase>_cpu_s``, ``<phase>_rss_mib``,
``<phase>_torch_loaded``, ``inspect_cpu_ratio`` and ``supervisor_cpu_ratio`` (after / before,
paired per round), the machine and the date.

Today's figures (2026-11-26, the quiet 2-core VM, full run): inspect 3.03 s of CPU and 107 MiB
against 5.80 s and 276 MiB before (``inspect_cpu_ratio`` 0.49); the supervisor 2.08 s and 83 MiB
against 10.8 s and 375 MiB (``supervisor_cpu_ratio`` 0.19); a quick run gave 0.49 and 0.18
(docs/PERFORMANCE.md, "Command start-up").
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from harness.reporting import arguments, banner, finish, machine_info, say

MODEL = "from pathlib import Path; model = Path({model!r}); "
PHASES = {
    "inspect": MODEL + "import turnstream.inspect.command as c; c._tokenizer(model, model.parent)",
    "inspect_before": MODEL
    + "import turnstream.inspect.command; from transformers import AutoTokenizer; "
    + "AutoTokenizer.from_pretrained(model)",
    "supervisor": "import turnstream.services.gateway.command",
    "supervisor_before": "import turnstream.services.gateway.command; "
    + "from transformers import AutoTokenizer, GenerationConfig; "
    + "import gateway.backends.local",
}
# Read by the phase itself: a child's rusage counts the parent's pages it was forked with.
TAIL = (
    "; import sys, re; hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()); "
    "print('torch' in sys.modules, int(hwm[1]))"
)


def run_phase(code: str) -> tuple[float, float, bool]:
    """CPU seconds, peak RSS (MiB) and whether torch was loaded, of one fresh interpreter."""
    process = subprocess.Popen(
        [sys.executable, "-c", code + TAIL], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert process.stdout is not None
    printed = process.stdout.read().decode().split()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0 or len(printed) != 2:
        raise SystemExit(f"the phase failed (exit {process.returncode}): {code}")
    return usage.ru_utime + usage.ru_stime, int(printed[1]) / 1024, printed[0] == "True"


def main() -> None:
    args = arguments(__doc__, "4 rounds instead of 10").parse_args()
    rounds = 4 if args.quick else 10
    info = machine_info("transformers", "tokenizers", "torch")
    banner("command start-up", args.quick, info)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        made = subprocess.run(  # in a child: this process stays free of torch
            [sys.executable, "-c", "import sys; from pathlib import Path; from gateway.model "
             "import ensure_tiny_model; print(ensure_tiny_model(Path(sys.argv[1])))", tmp],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        model = made.stdout.strip().splitlines()[-1]
        cpu: dict[str, list[float]] = {name: [] for name in PHASES}
        rss: dict[str, list[float]] = {name: [] for name in PHASES}
        torch_loaded: dict[str, bool] = {}
        order = list(PHASES)
        for round_ in range(rounds):
            for name in order if round_ % 2 == 0 else order[::-1]:
                seconds, mib, loaded = run_phase(PHASES[name].format(model=model))
                cpu[name].append(seconds)
                rss[name].append(mib)
                torch_loaded[name] = loaded
            say(
                f"round {round_ + 1}/{rounds}: "
                + ", ".join(f"{n} {cpu[n][-1]:.2f} s CPU, {rss[n][-1]:.0f} MiB" for n in order)
            )
    figures: dict[str, object] = {}
    for name in order:
        figures[f"{name}_cpu_s"] = round(statistics.median(cpu[name]), 3)
        figures[f"{name}_rss_mib"] = round(statistics.median(rss[name]), 1)
        figures[f"{name}_torch_loaded"] = torch_loaded[name]
    for after, before in (("inspect", "inspect_before"), ("supervisor", "supervisor_before")):
        paired = [a / b for a, b in zip(cpu[after], cpu[before], strict=True)]
        figures[f"{after}_cpu_ratio"] = round(statistics.median(paired), 3)
    say(
        f"\ninspect's tokenizer {figures['inspect_cpu_s']} s CPU, {figures['inspect_rss_mib']} "
        f"MiB vs before {figures['inspect_before_cpu_s']} s, "
        f"{figures['inspect_before_rss_mib']} MiB (ratio {figures['inspect_cpu_ratio']}); the "
        f"supervisor {figures['supervisor_cpu_s']} s, {figures['supervisor_rss_mib']} MiB vs "
        f"{figures['supervisor_before_cpu_s']} s, {figures['supervisor_before_rss_mib']} MiB "
        f"(ratio {figures['supervisor_cpu_ratio']})"
    )
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    main()
