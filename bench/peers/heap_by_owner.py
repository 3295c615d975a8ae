#!/usr/bin/env python3
"""Splits heaptrack's peak heap by the crate that allocated it.

Usage: heap_by_owner.py STACKS N
  STACKS  heaptrack_print -f FILE.zst -F STACKS --flamegraph-cost-type peak
  N       what to divide by (the connections held, from hold_connections.py)

Each stack is charged to the allocation's nearest frame in h2, rustls,
hyper, tonic, meshca or tokio (in that order of precedence per frame); the
six largest call sites of each owner are listed.
"""
import sys, re, collections
# stacks root-first separated by ';', cost at the end
rules = [
 ("h2 (frame codec / buffers / stream state)", re.compile(r"\bh2::")),
 ("rustls (connection, record buffers)", re.compile(r"\brustls::")),
 ("hyper", re.compile(r"\bhyper::|hyper_util::")),
 ("tonic", re.compile(r"\btonic::")),
 ("meshca batched_io / tls accept", re.compile(r"meshca_ca::(batched_io|tls)")),
 ("meshca other", re.compile(r"meshca_ca::")),
 ("tokio (tasks, io registration)", re.compile(r"\btokio::")),
]
tot = collections.Counter(); detail = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    stack, _, cost = line.rstrip().rpartition(" ")
    cost = int(cost)
    frames = stack.split(";")
    cls = "other"
    # leaf-first: first matching crate nearest the allocation, but skip tokio if a higher-level crate allocates via it
    for f in reversed(frames):
        for name, rx in rules:
            if rx.search(f):
                cls = name; break
        if cls != "other": break
    tot[cls] += cost
    # leaf-most crate frame for detail
    leaf = next((f for f in reversed(frames) if re.search(r"(h2|rustls|hyper|tonic|tokio|meshca_ca)::", f)), "?")
    leaf = re.sub(r"::h[0-9a-f]{16}$", "", leaf)[:150]
    detail[cls][leaf] += cost
n = int(sys.argv[2])
for k, v in tot.most_common():
    print(f"{v/n:8.0f} B/conn  {k}")
    for leaf, c in detail[k].most_common(6):
        if c/n >= 100: print(f"      {c/n:7.0f}  {leaf}")
