"""The checkpoint benchmark's figures (bench_checkpoint.py): paired ratios, the printed
report and its JSON last line, and the --scale curves with their plot."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

from _ckpt_variants import BREAKDOWN, MIB, Bench, median

BREAKDOWN_LABELS = {
    "dcp_nofsync": "  dcp.save, sync_files=False",
    "dcp_nozipcrc": "  dcp.save, no torch.save crc32",
    "writer": "  dcp.save + our crc32 writer",
    "writer_nozipcrc": "  our writer, no torch.save crc32",
    "sync_wt2": "  ours, sync, write_threads=2",
}


def paired(res: dict[str, list[dict[str, Any]]], v: str, base: str = "write2") -> float:
    """Median over repetitions of base time / v time, both from the same repetition."""
    return median([b["seconds"] / r["seconds"] for b, r in zip(res[base], res[v], strict=True)])


def load_figures(res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Seconds of each load variant (median) and its ratio to read2, paired per repetition."""
    loads = [r["loads"] for r in res["sync"]]
    out: dict[str, Any] = {"seconds": {}, "vs_read2": {}}
    for k in ("read2", "load", "load2", "dcp_load"):
        out["seconds"][k] = median([x[k]["seconds"] for x in loads])
        out["vs_read2"][k] = median([x["read2"]["seconds"] / x[k]["seconds"] for x in loads])
    out["cpu"] = {k: median([x[k]["cpu"] for x in loads]) for k in ("load", "load2", "dcp_load")}
    return out


def reshard_figures(res: dict[str, list[dict[str, Any]]]) -> dict[str, float] | None:
    if not res.get("reshard"):
        return None
    rs = res["reshard"]
    return {
        "2to1": median([r["2to1"] / r["1to1"] for r in rs]),
        "1to2": median([r["1to2"] / r["2to2"] for r in rs]),
        **{f"{k}_s": median([r[k] for r in rs]) for k in ("2to1", "1to1", "1to2", "2to2")},
    }


def header(b: Bench) -> str:
    import torch

    return (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; load average at start "
        f"{b.load_start:.2f}, now {os.getloadavg()[0]:.2f} (1 min); page cache dropped before "
        f"each variant: {'yes' if b.drop_caches else 'NO (not root): loads read from the cache'}"
    )


def report(b: Bench, res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, ratios, a table on stdout; returns the JSON summary."""
    args = b.args
    payload = b.payload
    gb = payload / 1e9
    base_steps = [t for r in res["steps"] for t in r["step_times"]]
    base = median(base_steps)
    base_cpu = median([r["cpu_per_step"] for r in res["steps"]])
    timed = ["write2", "write2_drop", "dd1", "dd2", "torch_save", "dcp", "sync"]
    timed += BREAKDOWN if args.breakdown else []
    med = {k: median([r["seconds"] for r in res[k]]) for k in timed}
    cpu = {k: median([r["cpu"] for r in res[k]]) for k in timed}
    asy = res["async"]
    blocked = [r["blocked"] for r in asy]
    stalls = [r["window"] - len(r["step_times"]) * base for r in asy]
    extra_cpu = [r["cpu"] - len(r["step_times"]) * base_cpu for r in asy]
    during = [t for r in asy for t in r["step_times"]]
    lf = load_figures(res)
    rf = reshard_figures(res)

    lines = [
        f"state: FSDP2 {args.layers} x Linear({args.width}, {args.width}) + AdamW on "
        f"{b.world} ranks, {payload / MIB:.1f} MiB ({payload} bytes); {args.reps} repetitions; "
        + header(b),
        "seconds: median (min..max), wall time barrier to barrier; CPU: median CPU seconds, "
        "both ranks; x disk = write2 time / variant time and x dd2 the same for dd2, each the "
        "median over repetitions of the ratio within the repetition",
        f"{'variant':<34}{'seconds':>24}{'GB/s':>7}{'CPU s':>7}{'x disk':>7}{'x dd2':>7}",
    ]
    labels = {
        "write2": "write2: 2 ranks write()+fsync",
        "write2_drop": "write2, pages dropped behind",
        "dd1": "dd conv=fdatasync, 1 stream",
        "dd2": "dd conv=fdatasync, 2 streams",
        "torch_save": "gather to rank 0 + torch.save",
        "dcp": "plain dcp.save",
        "sync": "ours, sync save",
        **BREAKDOWN_LABELS,
    }
    for k in timed:
        v = [r["seconds"] for r in res[k]]
        rng = f"{med[k]:.3f} ({min(v):.3f}..{max(v):.3f})"
        lines.append(
            f"{labels[k]:<34}{rng:>24}{gb / med[k]:>7.2f}{cpu[k]:>7.2f}"
            f"{paired(res, k):>7.2f}{paired(res, k, 'dd2'):>7.2f}"
        )
    for what, rs in (("sync", res["sync"]), ("async", asy)):
        ev = [r["events"] for r in rs if r["events"]]
        if ev:  # rank 0's own events: from staged to written, then manifest + commit
            lines.append(
                f"ours, {what}, rank 0's own split: dcp.save "
                f"{median([e['write_s'] for e in ev]):.3f} s, manifest+commit "
                f"{median([e['commit_s'] for e in ev]):.3f} s, save() to committed "
                f"{median([e['seconds'] for e in ev]):.3f} s"
            )
    lines += ["", "loads of the sync save (page cache dropped), x read2 = read2 time / load time:"]
    load_labels = {
        "read2": "read2: each rank reads its files",
        "load": "ours, verified in one pass",
        "load2": "ours, check then read (2 passes)",
        "dcp_load": "plain dcp.load, no verification",
    }
    for k, label in load_labels.items():
        c = lf["cpu"].get(k)
        lines.append(
            f"{label:<34}{lf['seconds'][k]:>10.3f} s{gb / lf['seconds'][k]:>7.2f} GB/s"
            f"{'' if c is None else f'{c:>7.2f} CPU s'}  x read2 {lf['vs_read2'][k]:.2f}"
        )
    if rf:
        lines.append(
            f"resharded loads (bitwise checked): 2->1 {rf['2to1_s']:.3f} s vs 1->1 "
            f"{rf['1to1_s']:.3f} s = {rf['2to1']:.2f}; 1->2 {rf['1to2_s']:.3f} s vs 2->2 "
            f"{rf['2to2_s']:.3f} s = {rf['1to2']:.2f} (medians of per-repetition ratios)"
        )
    q = statistics.quantiles(base_steps, n=4) if len(base_steps) > 1 else [base] * 3
    lines += [
        "",
        f"baseline step: {base * 1e3:.1f} ms (median of {len(base_steps)}, quartiles "
        f"{q[0] * 1e3:.1f}..{q[2] * 1e3:.1f}), {base_cpu:.2f} CPU s (both ranks)",
        f"async save: loop blocked first {blocked[0]:.4f} s, median {median(blocked):.4f} s "
        f"(in save() {median([r['in_save'] for r in asy]):.4f}, in the fence "
        f"{median([r['fence'] for r in asy]):.4f})",
        f"  save() until no rank has it in flight: {median([r['window'] for r in asy]):.3f} s, "
        f"{median([len(r['step_times']) for r in asy]):.0f} step(s) ran meanwhile: "
        f"{median(during) * 1e3:.1f} ms median, {max(during) * 1e3:.1f} ms max",
        f"  effective stall (that time - steps x baseline step): median {median(stalls):.3f} s "
        f"(min {min(stalls):.3f}, max {max(stalls):.3f}); extra CPU {median(extra_cpu):.2f} s",
    ]
    summary: dict[str, Any] = {
        "async_blocked_over_sync_dcp": median(blocked) / med["dcp"],
        "async_first_blocked_over_sync_dcp": blocked[0] / med["dcp"],
        "effective_stall_over_sync": median(stalls) / med["sync"],
        "effective_stall_over_sync_dcp": median(stalls) / med["dcp"],
        "sync_throughput_over_disk": paired(res, "sync"),
        "sync_throughput_over_disk_drop": paired(res, "sync", "write2_drop"),
        "sync_throughput_over_dd": paired(res, "sync", "dd2"),
        "dcp_over_disk": paired(res, "dcp"),
        "torch_save_over_disk": paired(res, "torch_save"),
        "dd2_over_disk": paired(res, "dd2"),
        "disk_baseline": "write2",
        "cpu_s_per_gb": cpu["sync"] / gb,
        "cpu_s_per_gb_dcp": cpu["dcp"] / gb,
        "async_extra_cpu_s_per_gb": median(extra_cpu) / gb,
        "load_vs_get": lf["vs_read2"]["load"],
        "load2_vs_get": lf["vs_read2"]["load2"],
        "dcp_load_vs_get": lf["vs_read2"]["dcp_load"],
        "load_cpu_s_per_gb": lf["cpu"]["load"] / gb,
        "load2_cpu_s_per_gb": lf["cpu"]["load2"] / gb,
        "reshard_over_same": None if rf is None else {k: rf[k] for k in ("2to1", "1to2")},
        "scale": [],
        "bytes": payload,
        "reps": args.reps,
        "load_avg_start": b.load_start,
        "load_avg_end": os.getloadavg()[0],
        "page_cache_dropped": b.drop_caches,
        "quick": bool(args.quick),
        "seconds": med,
        "cpu_seconds": cpu,
        "load_seconds": lf["seconds"],
        "async_blocked_s": median(blocked),
        "async_first_blocked_s": blocked[0],
        "effective_stall_s": median(stalls),
        "async_extra_cpu_s": median(extra_cpu),
        "baseline_step_s": base,
        "step_during_save_s": median(during),
        "async_window_s": median([r["window"] for r in asy]),
    }
    live = res.get("async_live")
    if live:
        live_stalls = [r["window"] - len(r["step_times"]) * base for r in live]
        live_cpu = [r["cpu"] - len(r["step_times"]) * base_cpu for r in live]
        summary["live_blocked_over_sync_dcp"] = median([r["blocked"] for r in live]) / med["dcp"]
        summary["live_effective_stall_over_sync"] = median(live_stalls) / med["sync"]
        summary["live_extra_cpu_s"] = median(live_cpu)
        lines.append(
            f"prototype, no staging (write from the live tensors, the fence holds the step): "
            f"blocked median {median([r['blocked'] for r in live]):.4f} s (fence "
            f"{median([r['fence'] for r in live]):.4f}), effective stall median "
            f"{median(live_stalls):.3f} s = {summary['live_effective_stall_over_sync']:.3f} x "
            f"sync; extra CPU {median(live_cpu):.2f} s"
        )
    lines += [
        "",
        "targets:",
        "  async blocked / sync dcp.save <= 0.03: median "
        f"{summary['async_blocked_over_sync_dcp']:.3f}, first "
        f"{summary['async_first_blocked_over_sync_dcp']:.3f}",
        f"  effective stall / our sync save <= 0.5 (stretch 0.25): "
        f"{summary['effective_stall_over_sync']:.3f}"
        f" (over sync dcp.save {summary['effective_stall_over_sync_dcp']:.3f})",
        f"  our sync throughput / disk (write2) >= 0.9: {summary['sync_throughput_over_disk']:.3f}"
        f" (over write2 with pages dropped behind, as ours does "
        f"{summary['sync_throughput_over_disk_drop']:.3f}; over dd2 "
        f"{summary['sync_throughput_over_dd']:.3f}); plain dcp.save "
        f"{summary['dcp_over_disk']:.3f}, torch.save {summary['torch_save_over_disk']:.3f}",
        f"  CPU s per GB saved: ours {summary['cpu_s_per_gb']:.2f} (plain dcp.save "
        f"{summary['cpu_s_per_gb_dcp']:.2f}); async, extra over the steps: "
        f"{summary['async_extra_cpu_s_per_gb']:.2f}",
        f"  load / read2: {summary['load_vs_get']:.3f} (two passes {summary['load2_vs_get']:.3f}"
        f", plain dcp.load {summary['dcp_load_vs_get']:.3f})",
    ]
    if rf:
        lines.append(
            f"  resharded / same-topology load <= 1.5: 2->1 {rf['2to1']:.2f}, 1->2 {rf['1to2']:.2f}"
        )
    print("\n".join(lines), flush=True)
    print(json.dumps(_rounded(summary)), flush=True)
    return summary


def stall_report(b: Bench, res: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """--stall: each async save's effective stall against the baseline steps of its own
    repetition (the machine's pace drifts between minutes), over the sync save of the same
    repetition; medians over repetitions. Prints the figures and the JSON summary."""
    summary: dict[str, Any] = {
        "sync_s": median([r["seconds"] for r in res["sync"]]),
        "baseline_step_s": median([median(r["step_times"]) for r in res["steps"]]),
        "bytes": b.payload,
        "reps": b.args.reps,
    }
    lines = [
        f"effective stall of an async save, {b.payload / MIB:.1f} MiB, {b.args.reps} "
        f"repetitions; " + header(b),
        "stall = save() until no rank has it in flight - steps x the median step of the same "
        "repetition's baseline; ratio = stall / the same repetition's sync save",
    ]
    labels = {"async": "the product's async save", "async_live": "prototype, no staging"}
    for arm in (a for a in labels if a in res):
        stalls, ratios, cpus = [], [], []
        for r, steps, sync in zip(res[arm], res["steps"], res["sync"], strict=True):
            base = median(steps["step_times"])
            n = len(r["step_times"])
            stalls.append(r["window"] - n * base)
            ratios.append(stalls[-1] / sync["seconds"])
            cpus.append(r["cpu"] - n * steps["cpu_per_step"])
        fig = {
            "effective_stall_s": median(stalls),
            "effective_stall_over_sync": median(ratios),
            "ratios": ratios,
            "extra_cpu_s": median(cpus),
            "blocked_s": median([r["blocked"] for r in res[arm]]),
            "window_s": median([r["window"] for r in res[arm]]),
        }
        summary[arm] = fig
        lines.append(
            f"{labels[arm]}: effective stall median {fig['effective_stall_s']:.3f} s, / sync "
            f"save median {fig['effective_stall_over_sync']:.3f} ({min(ratios):.2f}.."
            f"{max(ratios):.2f}); extra CPU {fig['extra_cpu_s']:.2f} s (both ranks); blocked "
            f"{fig['blocked_s'] * 1e3:.1f} ms; save() until no rank has it in flight "
            f"{fig['window_s']:.3f} s"
        )
    lines.append(
        f"sync save median {summary['sync_s']:.3f} s; baseline step median "
        f"{summary['baseline_step_s'] * 1e3:.1f} ms"
    )
    summary["load_avg_start"] = b.load_start
    summary["load_avg_end"] = os.getloadavg()[0]
    print("\n".join(lines), flush=True)
    print(json.dumps(_rounded(summary)), flush=True)
    return summary


SCALE_VARIANTS = ["sync", "dcp", "dd2", "write2_drop"]


def scale_shape(mib: int) -> tuple[int, int]:
    """(width, layers) of a Linear stack whose params + AdamW moments are about `mib` MiB."""
    width = 1024 if mib < 1024 else 2048
    per_layer = 3 * 4 * width * (width + 1)
    return width, max(1, round(mib * MIB / per_layer))


def scale(b: Bench) -> dict[str, Any]:
    """Save and load curves over --sizes; returns the JSON summary with its `scale` list."""
    args = b.args
    entries = []
    for mib in args.size_list:
        width, layers = scale_shape(mib)
        args.width, args.layers = width, layers
        b.build(width, layers)
        variants = list(SCALE_VARIANTS)
        if mib <= args.reshard_max_mib:
            variants.append("reshard")
        res = b.run(variants)
        gb = b.payload / 1e9
        lf = load_figures(res)
        rf = reshard_figures(res)
        e = {
            "mib": round(b.payload / MIB, 1),
            "bytes": b.payload,
            "shape": f"{layers} x Linear({width}, {width})",
            "save_s": median([r["seconds"] for r in res["sync"]]),
            "dcp_s": median([r["seconds"] for r in res["dcp"]]),
            "disk_s": median([r["seconds"] for r in res["write2"]]),
            "dd2_s": median([r["seconds"] for r in res["dd2"]]),
            "load_s": lf["seconds"]["load"],
            "read_s": lf["seconds"]["read2"],
            "save_over_disk": paired(res, "sync"),
            "save_over_disk_drop": paired(res, "sync", "write2_drop"),
            "dcp_over_disk": paired(res, "dcp"),
            "load_over_read": lf["vs_read2"]["load"],
            "cpu_s_per_gb": median([r["cpu"] for r in res["sync"]]) / gb,
            "reshard_over_same": None if rf is None else {k: rf[k] for k in ("2to1", "1to2")},
            "load_avg": os.getloadavg()[0],
        }
        e["save_gbps"] = gb / e["save_s"]
        e["disk_gbps"] = gb / e["disk_s"]
        e["load_gbps"] = gb / e["load_s"]
        e["read_gbps"] = gb / e["read_s"]
        entries.append(e)
        if b.rank == 0:
            print(f"# {mib} MiB done: {json.dumps(_rounded(e))}", file=sys.stderr, flush=True)
    lines = [
        f"scale: FSDP2 Linear stacks + AdamW on {b.world} ranks, {args.reps} repetitions per "
        "size; " + header(b),
        "save = our sync save, disk = write2 (2 ranks write()+fsync), load = ours (verified, one"
        " pass), read = read2; ratios are medians of per-repetition ratios",
        f"{'MiB':>7}{'save s':>8}{'GB/s':>6}{'disk GB/s':>10}{'save/disk':>10}{'/drop':>7}"
        f"{'load s':>8}"
        f"{'GB/s':>6}{'read GB/s':>10}{'load/read':>10}{'CPU s/GB':>9}{'2->1':>6}{'1->2':>6}",
    ]
    for e in entries:
        rs = e["reshard_over_same"] or {}
        lines.append(
            f"{e['mib']:>7.0f}{e['save_s']:>8.2f}{e['save_gbps']:>6.2f}{e['disk_gbps']:>10.2f}"
            f"{e['save_over_disk']:>10.2f}{e['save_over_disk_drop']:>7.2f}"
            f"{e['load_s']:>8.2f}{e['load_gbps']:>6.2f}"
            f"{e['read_gbps']:>10.2f}{e['load_over_read']:>10.2f}{e['cpu_s_per_gb']:>9.2f}"
            + "".join(f"{rs[k]:>6.2f}" if k in rs else f"{'-':>6}" for k in ("2to1", "1to2"))
        )
    summary = {
        "bench": "checkpoint_scale",
        "reps": args.reps,
        "load_avg_start": b.load_start,
        "load_avg_end": os.getloadavg()[0],
        "page_cache_dropped": b.drop_caches,
        "cpu_s_per_gb": median([e["cpu_s_per_gb"] for e in entries]),
        "load_vs_get": median([e["load_over_read"] for e in entries]),
        "reshard_over_same": [e["reshard_over_same"] for e in entries if e["reshard_over_same"]],
        "scale": entries,
    }
    if b.rank == 0:
        print("\n".join(lines), flush=True)
        if args.plot:
            plot(entries, args.plot, header(b))
        print(json.dumps(_rounded(summary)), flush=True)
    return summary


def plot(entries: list[dict[str, Any]], path: str, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [e["mib"] for e in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
    for key, label, style in (
        ("save_s", "our sync save", "o-"),
        ("disk_s", "disk: write()+fsync, 2 ranks", "s--"),
        ("load_s", "our load (verified, 1 pass)", "^-"),
        ("read_s", "read of the same files", "v--"),
    ):
        left.plot(x, [e[key] for e in entries], style, label=label)
    left.set(xscale="log", yscale="log", xlabel="state (MiB)", ylabel="seconds")
    left.set_title("time against state size")
    left.legend(fontsize=8)
    for key, label, style in (
        ("save_over_disk", "save / disk", "o-"),
        ("load_over_read", "load / read", "^-"),
    ):
        right.plot(x, [e[key] for e in entries], style, label=label)
    right.axhline(0.9, color="grey", lw=0.8, ls=":")
    right.set(xscale="log", xlabel="state (MiB)", ylabel="rate ratio (1 = the disk's pace)")
    right.set_ylim(0, max(1.2, *(e["save_over_disk"] for e in entries)) * 1.05)
    right.set_title("ratio to the baseline, per repetition")
    right.legend(fontsize=8)
    fig.suptitle("checkpoint save/load, FSDP2 + AdamW, 2 ranks", fontsize=10)
    fig.text(0.01, 0.01, note, fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)


def _rounded(o: Any) -> Any:
    if isinstance(o, float):
        return round(o, 4)
    if isinstance(o, dict):
        return {k: _rounded(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_rounded(v) for v in o]
    return o
