"""Workload files: a small TOML describing jobs, their cron mix, run times and faulty shares.

Example (``benchmarks/workloads/mixed.toml``)::

    name = "mixed"
    jobs = 20                      # number of jobs
    seed = 1                       # drawing of run times and of which job is faulty
    concurrency_mode = "Skip"      # Skip | Queue | Concurrent
    missed_run_policy = "RunOnce"  # RunOnce | Skip | RunAll
    max_jitter_s = 0.0             # given to the hourly jobs only (jitter must stay below the interval)
    [cron_mix]                     # shares (normalised): every second, every minute at :00, hourly at :00
    every_second = 0.9
    every_minute = 0.1
    hourly = 0.0
    [runtime]                      # each job's run time, drawn once per job (ms)
    distribution = "uniform"       # fixed (mean_ms) | uniform (min_ms..max_ms) | exponential (mean_ms)
    min_ms = 10.0
    max_ms = 100.0
    [faults]                       # shares of jobs whose plugin hangs, crashes (worker exits) or leaks
    hang = 0.1
    crash = 0.0
    leak = 0.0
    leak_mb = 1.0                  # MB kept per run by a leaking job

:func:`load` raises :class:`WorkloadError` whose message starts with the offending field
(``runtime.distribution: ...``). :func:`job_specs` turns a workload into job dicts, deterministically.
"""

from __future__ import annotations

import random
import re
import tomllib
from pathlib import Path

import msgspec

CRONS = {"every_second": "* * * * * *", "every_minute": "0 * * * * *", "hourly": "0 0 * * * *"}
KINDS = ("hang", "crash", "leak")


class WorkloadError(ValueError):
    """Bad workload file; ``str()`` starts with the field path."""


class CronMix(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    every_second: float = 1.0
    every_minute: float = 0.0
    hourly: float = 0.0


class Runtime(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    distribution: str = "fixed"
    mean_ms: float = 10.0
    min_ms: float = 0.0
    max_ms: float = 0.0


class Faults(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    hang: float = 0.0
    crash: float = 0.0
    leak: float = 0.0
    leak_mb: float = 1.0


class Workload(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    name: str = "workload"
    jobs: int = 20
    seed: int = 1
    concurrency_mode: str = "Skip"
    missed_run_policy: str = "RunOnce"
    max_jitter_s: float = 0.0
    cron_mix: CronMix = msgspec.field(default_factory=CronMix)
    runtime: Runtime = msgspec.field(default_factory=Runtime)
    faults: Faults = msgspec.field(default_factory=Faults)


def _check(w: Workload) -> Workload:
    def bad(field: str, why: str) -> WorkloadError:
        return WorkloadError(f"{field}: {why}")
    if w.jobs < 1:
        raise bad("jobs", f"must be >= 1, got {w.jobs}")
    if w.concurrency_mode not in ("Skip", "Queue", "Concurrent"):
        raise bad("concurrency_mode", f"must be Skip, Queue or Concurrent, got {w.concurrency_mode!r}")
    if w.missed_run_policy not in ("Skip", "RunOnce", "RunAll"):
        raise bad("missed_run_policy", f"must be Skip, RunOnce or RunAll, got {w.missed_run_policy!r}")
    mix = msgspec.structs.asdict(w.cron_mix)
    for key, value in mix.items():
        if value < 0:
            raise bad(f"cron_mix.{key}", f"must be >= 0, got {value}")
    if sum(mix.values()) <= 0:
        raise bad("cron_mix", "shares must not all be 0")
    if w.runtime.distribution not in ("fixed", "uniform", "exponential"):
        raise bad("runtime.distribution", f"must be fixed, uniform or exponential, got {w.runtime.distribution!r}")
    for key in ("mean_ms", "min_ms", "max_ms"):
        if getattr(w.runtime, key) < 0:
            raise bad(f"runtime.{key}", f"must be >= 0, got {getattr(w.runtime, key)}")
    if w.runtime.distribution == "uniform" and w.runtime.max_ms < w.runtime.min_ms:
        raise bad("runtime.max_ms", f"must be >= runtime.min_ms ({w.runtime.min_ms}), got {w.runtime.max_ms}")
    for key in (*KINDS, "leak_mb"):
        value = getattr(w.faults, key)
        if key == "leak_mb" and value < 0:
            raise bad("faults.leak_mb", f"must be >= 0 MiB, got {value}")
        if key != "leak_mb" and not 0 <= value <= 1:
            raise bad(f"faults.{key}", f"must be a share between 0 and 1, got {value}")
    if w.faults.hang + w.faults.crash + w.faults.leak > 1:
        raise bad("faults", "hang + crash + leak must be <= 1")
    return w


def parse(data: dict) -> Workload:
    """A workload from a decoded TOML table. Raises :class:`WorkloadError` naming the field."""
    try:
        return _check(msgspec.convert(data, Workload))
    except msgspec.ValidationError as exc:  # "Expected `int`, got `str` - at `$.runtime.mean_ms`"
        match = re.search(r"at `\$\.?([^`]*)`", str(exc))
        unknown = re.search(r"unknown field `([^`]*)`", str(exc))
        field = match.group(1) if match else "workload"
        if unknown:
            field = f"{field + '.' if match and field else ''}{unknown.group(1)}"
        raise WorkloadError(f"{field}: {str(exc).split(' - at ')[0]}") from None


def check(w: Workload) -> Workload:
    """Validate a workload changed after loading (a command-line override). Raises :class:`WorkloadError`."""
    return _check(w)


def load_or_exit(path: str | Path) -> Workload:
    """:func:`load` for the scripts: a bad workload prints one line naming the field and exits 2."""
    try:
        return load(path)
    except (WorkloadError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None  # SystemExit with a message exits with status 1


def load(path: str | Path) -> Workload:
    """Read and check a workload TOML file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML ({exc})") from None
    return parse(data)


def _apportion(shares: dict[str, float], n: int) -> list[str]:
    """``n`` labels in proportion to ``shares`` (largest remainder), in a fixed order."""
    total = sum(shares.values())
    exact = {k: v / total * n for k, v in shares.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - counts[k], reverse=True)[: n - sum(counts.values())]:
        counts[k] += 1
    return [k for k in shares for _ in range(counts[k])]


def job_columns(w: Workload) -> dict[str, list]:
    """The workload as columns (cheap for a million jobs): ``cron_kind``, ``kind``, ``runtime_ms`` lists,
    index = job number. Same workload, same columns (seeded)."""
    rng = random.Random(w.seed)
    crons = _apportion(msgspec.structs.asdict(w.cron_mix), w.jobs)
    faulty = {k: round(getattr(w.faults, k) * w.jobs) for k in KINDS}
    kinds = [k for k in KINDS for _ in range(faulty[k])]
    kinds += ["ok"] * (w.jobs - len(kinds))
    rng.shuffle(kinds)
    r = w.runtime
    if r.distribution == "fixed":
        runtimes = [r.mean_ms] * w.jobs
    elif r.distribution == "uniform":
        runtimes = [round(rng.uniform(r.min_ms, r.max_ms), 3) for _ in range(w.jobs)]
    else:
        runtimes = [round(rng.expovariate(1 / r.mean_ms), 3) if r.mean_ms else 0.0 for _ in range(w.jobs)]
    return {"cron_kind": crons, "kind": kinds, "runtime_ms": runtimes}


def job_name(w: Workload, i: int) -> str:
    return f"{w.name}-{i:07d}"


def job_specs(w: Workload) -> list[dict]:
    """One dict per job: ``name``, ``job_type`` ("bench"), ``cron_expression``, ``cron_kind``, ``kind``
    (ok/hang/crash/leak), ``runtime_ms``, ``configuration``, ``concurrency_mode``, ``missed_run_policy``,
    ``max_jitter_s``. Same workload, same list (seeded)."""
    cols = job_columns(w)
    specs = []
    for i, (cron_kind, kind, runtime_ms) in enumerate(zip(cols["cron_kind"], cols["kind"], cols["runtime_ms"])):
        config = {"kind": kind, "runtime_ms": runtime_ms}
        if kind == "leak":
            config["leak_mb"] = w.faults.leak_mb
        specs.append({"name": job_name(w, i), "job_type": "bench", "cron_expression": CRONS[cron_kind],
                      "cron_kind": cron_kind, "kind": kind, "runtime_ms": runtime_ms,
                      "configuration": config, "concurrency_mode": w.concurrency_mode,
                      "missed_run_policy": w.missed_run_policy,
                      "max_jitter_s": w.max_jitter_s if cron_kind == "hourly" else 0.0})
    return specs


def jobs_toml(w: Workload) -> str:
    """The workload as a ``serve --jobs`` file."""
    out = []
    for s in job_specs(w):
        out += ["[[jobs]]", f'name = "{s["name"]}"', 'job_type = "bench"',
                f'cron_expression = "{s["cron_expression"]}"', f'concurrency_mode = "{s["concurrency_mode"]}"',
                f'missed_run_policy = "{s["missed_run_policy"]}"', f'max_jitter_s = {float(s["max_jitter_s"])}',
                "[jobs.configuration]"]
        out += [f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {float(v)}" for k, v in s["configuration"].items()]
        out.append("")
    return "\n".join(out)
