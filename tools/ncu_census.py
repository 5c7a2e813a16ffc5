#!/usr/bin/env python3
"""ncu_census.py CSV [--per N] -- a kernel census from Nsight Compute's CSV: GPU time and
launches per kernel name, largest first, as milliseconds per step when --per N names the
number of steps the profiled command ran (else the whole run).

The CSV is what `ncu --csv --clock-control none --metrics gpu__time_duration.sum CMD`
prints (one row per launch; the profiled program's own output may be mixed in: rows
that are not ncu's are skipped).
"""
import argparse
import csv
import sys
from collections import defaultdict

UNIT_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
           "second": 1e3, "s": 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--per", type=int, default=1, help="steps the command ran (default 1)")
    ap.add_argument("--top", type=int, default=40, help="rows to print (default 40)")
    args = ap.parse_args()
    if args.per < 1:
        sys.exit("ncu_census.py: --per: expected a positive number of steps, got %d" % args.per)
    total, launches = defaultdict(float), defaultdict(int)
    header = None
    with open(args.csv, newline="") as f:
        for row in csv.reader(f):
            if header is None:
                if "Kernel Name" in row and "Metric Value" in row:
                    header = {name: i for i, name in enumerate(row)}
                continue
            if len(row) != len(header) or row[header["Metric Name"]] != "gpu__time_duration.sum":
                continue
            unit = row[header["Metric Unit"]]
            if unit not in UNIT_MS:
                sys.exit("ncu_census.py: unknown time unit %r" % unit)
            name = row[header["Kernel Name"]]
            total[name] += float(row[header["Metric Value"]].replace(",", "")) * UNIT_MS[unit]
            launches[name] += 1
    if header is None:
        sys.exit("ncu_census.py: %s: no ncu CSV header (Kernel Name, Metric Value) found" % args.csv)
    all_ms = sum(total.values())
    print("total %.3f ms over %d launches, %.3f ms per step (%d steps)"
          % (all_ms, sum(launches.values()), all_ms / args.per, args.per))
    print("  ms/step  launches  kernel")
    for name in sorted(total, key=total.get, reverse=True)[: args.top]:
        print("%9.3f  %8d  %s" % (total[name] / args.per, launches[name], name[:110]))


if __name__ == "__main__":
    main()
