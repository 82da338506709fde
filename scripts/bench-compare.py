#!/usr/bin/env python3
"""Compares two builds' `bench control` and `bench transports` runs in one
bench-results folder: the `ratio:` lines each run printed (`base-SUITE-N.log`
and `head-SUITE-N.log`), their median over the runs at each build, and the
quotient of the two medians, flagged when outside ±10 %.

    python3 scripts/bench-compare.py DIR BASE HEAD [--rounds N]

BASE and HEAD name the builds in the table (commits); --rounds N reads runs
1..N only (default: every run in DIR). Prints a Markdown table.
"""
import argparse, glob, os, re, statistics


def ratios(path):
    out = {}
    for line in open(path):
        if not line.startswith('ratio:'):
            continue
        body = line[len('ratio:'):].strip()
        body = re.sub(r'\(-?\d+ ns per tensor more\)', '', body).strip()
        rx = r'(?<=\s)(\d+(?:\.\d+)?)x(?=[\s,]|$)'
        nums = re.findall(rx, body)
        key = re.sub(rx, 'Nx', body)
        for i, n in enumerate(nums):
            out[f'{key} #{i}' if len(nums) > 1 else key] = float(n)
    return out


def medians(d, kind, suite, rounds):
    if rounds is None:
        paths = sorted(glob.glob(os.path.join(d, f'{kind}-{suite}-*.log')))
    else:
        paths = [os.path.join(d, f'{kind}-{suite}-{i}.log') for i in range(1, rounds + 1)]
    runs = [ratios(p) for p in paths]
    keys = set().union(*runs) if runs else set()
    return (
        {k: statistics.median([r[k] for r in runs if k in r]) for k in keys},
        len(runs),
        {k: [r.get(k) for r in runs] for k in keys},
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('dir')
    ap.add_argument('base')
    ap.add_argument('head')
    ap.add_argument('--rounds', type=int)
    a = ap.parse_args()
    worst = 0
    for suite in ['control', 'transports']:
        b, nb, braw = medians(a.dir, 'base', suite, a.rounds)
        h, nh, hraw = medians(a.dir, 'head', suite, a.rounds)
        print(f'## {suite} (runs: {a.base} {nb}, {a.head} {nh})')
        print(f'| ratio | {a.base} (median; runs) | {a.head} (median; runs) | {a.head}/{a.base} |')
        print('| --- | --- | --- | --- |')
        for k in sorted(set(b) | set(h)):
            if k in b and k in h:
                q = h[k] / b[k]
                worst = max(worst, abs(q - 1))
                flag = '' if abs(q - 1) <= 0.10 else ' **outside ±10 %**'
                fr = lambda v: ', '.join(f'{x:.2f}' for x in v if x is not None)
                print(f'| {k} | {b[k]:.2f} ({fr(braw[k])}) | {h[k]:.2f} ({fr(hraw[k])}) | {q:.3f}{flag} |')
            else:
                print(f'| {k} | {b.get(k, "-")} | {h.get(k, "-")} | (one side only) |')
    print(f'\nlargest change: {worst*100:.1f} %')


if __name__ == '__main__':
    main()
