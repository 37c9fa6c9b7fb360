"""Every figure benchmarks/RESULTS.md keeps names a command that still runs: the driver it calls exists, and its
sub-command and every option it passes are ones the driver's argument parser offers today.

A section whose script was removed says so ("From a removed script: ``git show <commit>:benchmarks/<name>``") and is
not checked: its figures come from that commit.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
REMOVED = "From a removed script"
_SCRIPT = re.compile(r"benchmarks/([\w/]+\.py)")
_STOP = {";", "&&", "||", "|", ">", ">>", "2>&1", "&", ")"}


def _sections() -> list[list[str]]:
    out: list[list[str]] = [[]]
    for line in RESULTS.read_text().splitlines():
        if line.startswith("## "):
            out.append([])
        out[-1].append(line)
    return out


def _code_lines(section: list[str]) -> list[str]:
    """The section's commands: its fenced code (continuation lines joined, shell variables assigned there
    expanded) and the inline code spans of its prose that run Python."""
    lines, fenced, held, names = [], False, "", {}
    for line in section:
        if line.startswith("```"):
            fenced, names = not fenced, {}
            continue
        if not fenced:
            lines += [span for span in re.findall(r"`([^`]+)`", line) if "python" in span]
            continue
        if line.rstrip().endswith("\\"):
            held += line.rstrip()[:-1] + " "
            continue
        line, held = held + line, ""
        assigned = re.match(r"\s*(\w+)=\"([^\"]*)\"\s*$", line)
        if assigned:
            names[assigned.group(1)] = assigned.group(2)
            continue
        lines.append(re.sub(r"\$(\w+)", lambda m: names.get(m.group(1), m.group(0)), line))
    return lines


def commands() -> list[tuple[str, str | None, tuple[str, ...], str]]:
    """(script, first positional argument, option names, the line) of every driver call RESULTS.md keeps."""
    found = []
    for section in _sections():
        if any(REMOVED in line for line in section):
            continue
        for line in _code_lines(section):
            if line.lstrip().startswith("#"):
                continue
            for m in _SCRIPT.finditer(line):
                tokens = []
                for tok in line[m.end():].split():
                    if tok in _STOP or tok.startswith((">", "2>", "#")):
                        break
                    tokens.append(tok)
                positional = next((t for t in tokens if not t.startswith("-")), None)
                if tokens and tokens[0].startswith("-"):
                    positional = None
                options = tuple(sorted({t.split("=", 1)[0] for t in tokens if t.startswith("--")}))
                found.append((m.group(1), positional, options, line.strip()))
    return found


@functools.cache
def _help(script: str, sub: str | None) -> str:
    argv = [sys.executable, str(REPO / "benchmarks" / script)] + ([sub] if sub else []) + ["--help"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "cpu_runtime"),
                                                        os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(argv[1:])} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _subcommands(script: str) -> set[str]:
    """The driver's sub-commands as argparse lists them: ``{a,b,c}``, or one per line (4 spaces in) under a
    metavar; none for a driver without."""
    text = _help(script, None)
    m = re.search(r"\{([\w,-]+)\}", text)
    if m:
        return set(m.group(1).split(","))
    positional = text.split("positional arguments:", 1)[1].split("\n\n", 1)[0] if "positional arguments:" in text else ""
    return set(re.findall(r"^    ([\w-]+)(?:\s|$)", positional, flags=re.M))


def test_results_keeps_commands_to_check():
    scripts = {c[0] for c in commands()}
    assert len(scripts) >= 4, scripts  # the question drivers at least


@pytest.mark.parametrize("script", sorted({c[0] for c in commands()}))
def test_every_driver_results_calls_exists_and_offers_what_results_passes(script):
    path = REPO / "benchmarks" / script
    assert path.is_file(), f"benchmarks/RESULTS.md runs benchmarks/{script}, which does not exist"
    subs = _subcommands(script)
    for name, positional, options, line in commands():
        if name != script:
            continue
        sub = None
        if subs:
            assert positional in subs, f"{line!r}: sub-command {positional!r} not among {sorted(subs)}"
            sub = positional
        text = _help(script, sub)
        offered = set(re.findall(r"--[\w-]+", text))
        missing = [o for o in options if o not in offered]
        assert not missing, f"{line!r}: benchmarks/{script} {sub or ''} offers no {missing}"
