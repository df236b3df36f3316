"""A model of refit time at scale (``dcr project``), built from measured costs.

Three methods move one optimizer step's weights from the trainer to every rollout node:

- dense: the trainer nodes serialise their shares of the checkpoint and upload them;
  every rollout node downloads the whole checkpoint and loads it;
- dcr over S3: the trainer nodes diff and encode their shares (``publish``) and
  upload the delta; every rollout node downloads the whole delta, verifies and
  applies it (``sync``);
- dcr with the relay tree: as above, but in each group of ``group_size`` nodes
  only the leader downloads; the bytes flow down a tree of fan-out ``fanout`` over the
  rollout cluster's own network (``fabric_gbps`` per node).

Every number that is a property of the software comes from a :class:`Costs`
record (:mod:`dcr_format.cli.costs`, the benchmark suite measures them): delta bytes per changed
element at each change rate, publish and sync CPU seconds per dense byte, dense
serialise/load seconds per byte, request latency, relay seconds per byte and per
round. The scenario supplies what belongs to the cluster: parameters, change rate,
nodes, link speed into the cluster, the fabric's speed inside it, store bandwidth, workers
per node. The stages of one refit are added up (the writers publish, the version
commits, then the readers fetch), with the overlaps the software has: a writer uploads
each shard while it codes the next tensors, so only its last shards and what the upload
takes beyond the coding are added (``upload``: :func:`upload_after`); chunks stream down
the relay tree; and a reader decodes and completes each object's changes as it arrives,
so that only the part of a sync measured after the last object
(``sync_tail_s_per_byte``) and what the rest takes beyond the delta's arrival are added
to the download (``apply``: :func:`apply_after`). Costs without that measure overlap
nothing of a sync.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the costs model needs pydantic; `dcr --help` lists this command without it
    from dcr_format.cli.costs import Costs, RateCosts

FABRIC_GBPS = 100.0
"""Default link of a rollout node inside its cluster: one 100 Gbps Ethernet/RoCE port, the
smallest common in GPU clusters (their GPU interconnect is usually 400 Gbps or more per GPU)."""

_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> float:
    """``1T``, ``120B``, ``7e9``, ``500M`` -> a number of parameters."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise ValueError(f"{text!r} is not a parameter count like 1T, 120B or 7e9")
    return float(match.group(1)) * _SUFFIX[match.group(2).upper()]


def format_count(n: float) -> str:
    """1e12 -> ``1T``, 1.2e11 -> ``120B``."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.4g}{suffix}"
    return f"{n:g}"


def parse_rate(text: str) -> float:
    """``3%`` or ``0.03`` -> 0.03."""
    value = text.strip()
    try:
        rate = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise ValueError(f"{text!r} is not a change rate like 3% or 0.03") from None
    if not 0 < rate <= 1:
        raise ValueError(f"change rate {text!r} must be in (0, 100%]")
    return rate


@dataclass(frozen=True)
class Scenario:
    """The cluster and the step a projection is for."""

    params: float
    change: float
    rollout_nodes: int = 64
    link_gbps: float = 5.0
    """Each node's network limit into and out of its cluster (trainer and rollout nodes, to
    and from the store), each direction."""
    fabric_gbps: float = FABRIC_GBPS
    """Each rollout node's link inside the rollout cluster (relay hops), each direction;
    0: the relay hop measured in the costs (gloo on one machine's loopback)."""
    trainer_nodes: int = 8
    """Nodes that publish (each uploads and encodes its share)."""
    workers: int = 8
    """Processes per node that encode or apply a share in parallel (one per GPU)."""
    store_gbps: float = 0.0
    """Aggregate bandwidth of the object store (all clients together); 0: no limit."""
    group_size: int = 8
    fanout: int = 2
    bytes_per_param: float = 2.0
    concurrency: int = 8
    """Requests a node keeps in flight (DeltaReader's max_workers)."""

    @property
    def dense_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Estimate:
    """One method's projected refit: seconds per stage, and what the store serves."""

    method: str
    terms: dict[str, float]
    kinds: dict[str, str]  # stage -> "network" | "compute" | "requests"
    moved_bytes: float  # per rollout node
    store_egress_bytes: float

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def by_kind(self, kind: str) -> float:
        return sum(s for name, s in self.terms.items() if self.kinds[name] == kind)


def _interp(costs: Costs, rate: float) -> tuple[RateCosts, bool]:
    """Costs at ``rate``: linear in log(rate) between measured rates, clamped outside."""
    from dcr_format.cli.costs import RateCosts

    points = sorted(costs.rates, key=lambda r: r.rate)
    if rate <= points[0].rate or len(points) == 1:
        return points[0].model_copy(update={"rate": rate}), rate < points[0].rate * 0.9
    if rate >= points[-1].rate:
        return points[-1].model_copy(update={"rate": rate}), rate > points[-1].rate * 1.1
    for low, high in itertools.pairwise(points):
        if low.rate <= rate <= high.rate:
            t = (math.log(rate) - math.log(low.rate)) / (math.log(high.rate) - math.log(low.rate))

            def mix(a: float, b: float, t: float = t) -> float:
                return a + (b - a) * t

            return (
                RateCosts(
                    rate=rate,
                    bytes_per_changed=mix(low.bytes_per_changed, high.bytes_per_changed),
                    publish_s_per_byte=mix(low.publish_s_per_byte, high.publish_s_per_byte),
                    sync_s_per_byte=mix(low.sync_s_per_byte, high.sync_s_per_byte),
                    sync_tail_s_per_byte=(
                        None
                        if low.sync_tail_s_per_byte is None or high.sync_tail_s_per_byte is None
                        else mix(low.sync_tail_s_per_byte, high.sync_tail_s_per_byte)
                    ),
                ),
                False,
            )
    raise AssertionError("unreachable")


def _tree_depth(members: int, fanout: int) -> int:
    depth, reached, level = 0, 1, 1
    while reached < members:
        level *= fanout
        reached += level
        depth += 1
    return depth


def delta_bytes(scenario: Scenario, costs: Costs) -> float:
    """Stored delta bytes of one step: changed elements times measured bytes per change."""
    at, _ = _interp(costs, scenario.change)
    return scenario.params * scenario.change * at.bytes_per_changed


def relay_hop_bytes_per_s(scenario: Scenario, costs: Costs) -> float:
    """Bytes per second of one relay hop: the fabric's link, or (``fabric_gbps`` 0) the hop
    measured in ``costs``, never faster than that link."""
    if scenario.fabric_gbps > 0:
        return scenario.fabric_gbps * 1e9 / 8
    return min(scenario.link_gbps * 1e9 / 8, costs.relay_hop_bytes_per_s)


def upload_after(upload_s: float, encode_s: float, last_s: float) -> float:
    """The seconds of a writer's upload of ``upload_s`` that its coding of ``encode_s`` does
    not hide: each shard is sent while the next tensors are coded, so the last shards
    (``last_s``) and what the upload takes beyond the coding are left."""
    return max(min(last_s, upload_s), upload_s - encode_s)


def apply_after(sync_s: float, tail_s: float | None, arrival_s: float) -> float:
    """The seconds of a reader's sync of ``sync_s`` that the download does not hide, where
    the delta takes ``arrival_s`` to arrive: the part after the last object (``tail_s``)
    and what the rest takes beyond the arrival; all of it where ``tail_s`` is None."""
    if tail_s is None:
        return sync_s
    after = min(sync_s, tail_s)
    return after + max(0.0, sync_s - after - arrival_s)


def project(scenario: Scenario, costs: Costs) -> list[Estimate]:
    """Dense, dcr over S3 and dcr with the relay tree for ``scenario``."""
    s, c = scenario, costs
    at, _ = _interp(c, s.change)
    dense = s.dense_bytes
    link = s.link_gbps * 1e9 / 8
    store = s.store_gbps * 1e9 / 8 if s.store_gbps > 0 else math.inf
    nodes, writers = s.rollout_nodes, s.trainer_nodes
    upload_rate = min(writers * link, store)
    per_node = min(link, store / nodes)
    delta = delta_bytes(s, c)

    def requests(nbytes: float) -> float:  # objects of at most one shard each, per writer
        return writers * math.ceil(nbytes / writers / c.shard_bytes)

    kinds = {
        "serialise": "compute",
        "encode": "compute",
        "upload": "network",
        "write requests": "requests",
        "download": "network",
        "read requests": "requests",
        "relay": "network",
        "relay rounds": "requests",
        "load": "compute",
        "apply": "compute",
    }
    dense_objects = requests(dense)
    estimates = [
        Estimate(
            "dense",
            {
                "serialise": dense * c.dense_serialise_s_per_byte / (writers * s.workers),
                "upload": dense / upload_rate,
                "write requests": dense_objects / writers / s.concurrency * c.request_s,
                "download": dense / per_node,
                "read requests": dense_objects / s.concurrency * c.request_s,
                "load": dense * c.dense_load_s_per_byte / s.workers,
            },
            kinds,
            dense,
            nodes * dense,
        )
    ]
    objects = requests(delta) + writers + 1  # shards, one manifest per writer, the commit
    encode = dense * at.publish_s_per_byte / (writers * s.workers)
    upload = delta / upload_rate
    # the shard each worker of a trainer node finishes last, sent after its coding ends
    last = min(upload, s.workers * min(c.shard_bytes, delta / (writers * s.workers)) / link)
    common = {
        "encode": encode,
        "upload": upload_after(upload, encode, last),
        "write requests": (objects / writers / s.concurrency + 1) * c.request_s,
    }
    sync = dense * at.sync_s_per_byte / s.workers
    tail = None if at.sync_tail_s_per_byte is None else dense * at.sync_tail_s_per_byte / s.workers
    read_requests = (objects / s.concurrency + 3) * c.request_s  # + listing, header, record
    estimates.append(
        Estimate(
            "dcr over S3",
            {
                **common,
                "download": delta / per_node,
                "read requests": read_requests,
                "apply": apply_after(sync, tail, delta / per_node),
            },
            kinds,
            delta,
            nodes * delta,
        )
    )
    groups = math.ceil(nodes / max(1, s.group_size))
    members = min(s.group_size, nodes)
    leader_rate = min(link, store / groups)
    hop = relay_hop_bytes_per_s(s, c)
    depth = _tree_depth(members, s.fanout)
    copies = min(s.fanout, members - 1)
    # the leader fetches object i+1 while object i streams down; chunks pipeline in the tree
    stream = max(delta / leader_rate, copies * delta / hop) if members > 1 else delta / leader_rate
    first = min(c.shard_bytes, delta) / leader_rate
    fill = depth * (c.chunk_bytes / hop + c.relay_round_s)
    estimates.append(
        Estimate(
            "dcr relay tree",
            {
                **common,
                "download": first,
                "relay": stream + fill,
                "read requests": read_requests,
                "relay rounds": objects * c.relay_round_s * (depth > 0),
                "apply": apply_after(sync, tail, first + stream + fill),
            },
            kinds,
            delta,
            groups * delta,
        )
    )
    return estimates


# --- published reference points ----------------------------------------------------------------

#: Bytes per parameter of the 120B reference (247.2 GB), also used for the 1T points.
REFERENCE_BYTES_PER_PARAM = 247.2e9 / 120e9


@dataclass(frozen=True)
class Reference:
    name: str
    params: float
    change: float | None  # None: a full transfer
    low_s: float
    high_s: float

    def published(self) -> str:
        if self.low_s == self.high_s:
            return _seconds(self.low_s)
        return f"{self.low_s:g}-{self.high_s:g} s"


REFERENCES = (
    Reference("120B full transfer (247.2 GB)", 120e9, None, 750.0, 750.0),
    Reference("120B delta at 3%", 120e9, 0.03, 22.6, 24.5),
    Reference("120B delta at 5%", 120e9, 0.05, 41.6, 49.7),
    Reference("1T delta at 3%", 1e12, 0.03, 150.0, 150.0),
    Reference("1T full transfer", 1e12, None, 87.5 * 60, 87.5 * 60),
)


def _seconds(x: float) -> str:
    if x >= 3600:
        return f"{x / 60:,.0f} min"
    if x >= 600:
        return f"{x / 60:.1f} min"
    return f"{x:.1f} s" if x < 100 else f"{x:.0f} s"


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def reference_rows(scenario: Scenario, costs: Costs) -> list[dict[str, Any]]:
    """The published points next to this model's projection of the same step (the scenario's
    cluster, the references' bytes per parameter)."""
    rows = []
    for ref in REFERENCES:
        at = replace(
            scenario,
            params=ref.params,
            change=ref.change or scenario.change,
            bytes_per_param=REFERENCE_BYTES_PER_PARAM,
        )
        estimates = {e.method: e for e in project(at, costs)}
        methods = ["dense"] if ref.change is None else ["dcr over S3", "dcr relay tree"]
        ours = {m: estimates[m].total for m in methods}
        mid = (ref.low_s + ref.high_s) / 2
        rows.append(
            {
                "reference": ref.name,
                "published_s": [ref.low_s, ref.high_s],
                "projected_s": ours,
                "ratio": {m: v / mid for m, v in ours.items()},
                "dominant": {
                    m: max(estimates[m].terms.items(), key=lambda kv: kv[1])[0] for m in methods
                },
                "without_compute_s": {
                    m: estimates[m].total - estimates[m].by_kind("compute") for m in methods
                },
                "compute_s": {m: estimates[m].by_kind("compute") for m in methods},
            }
        )
    return rows


def explain(scenario: Scenario, costs: Costs) -> list[str]:
    """Why the projection lands where it does against the published points."""
    full_rate = 247.2e9 / 750.0  # bytes per second of the published 120B full transfer
    implied = {
        rate: (low * full_rate / 247.2e9, high * full_rate / 247.2e9)
        for rate, low, high in ((0.03, 22.6, 24.5), (0.05, 41.6, 49.7))
    }
    lines = []
    for rate, (low, high) in implied.items():
        ours = delta_bytes(replace(scenario, params=1.0, change=rate, bytes_per_param=2.0), costs)
        lines.append(
            f"delta size at {rate:.0%}: the published 120B times at the published full-transfer "
            f"rate ({full_rate * 8 / 1e9:.2f} Gbps) imply a delta of {low:.1%}-{high:.1%} of "
            f"dense; the measured codec stores {ours / 2.0:.2%} of dense bf16 "
            f"({ours / rate:.2f} bytes per changed element)"
        )
    per_node = scenario.link_gbps
    if scenario.store_gbps > 0:
        per_node = min(per_node, scenario.store_gbps / scenario.rollout_nodes)
    full_1t = REFERENCE_BYTES_PER_PARAM * 1e12 * 8 / 5250 / 1e9
    lines.append(
        f"full transfer: the published 120B full transfer runs at {full_rate * 8 / 1e9:.2f} Gbps "
        f"end to end and the 1T one at {full_1t:.2f} Gbps (if it too is 2.06 B/param); this "
        f"model uploads once at {scenario.trainer_nodes} x {scenario.link_gbps:g} Gbps "
        f"and downloads at {per_node:.2f} Gbps per node"
        + (
            " (the link: no store limit given; the published runs were slower than their links)"
            if scenario.store_gbps <= 0 or per_node == scenario.link_gbps
            else " (the store's share per node)"
        )
    )
    hop = relay_hop_bytes_per_s(scenario, costs) * 8 / 1e9
    copies = min(scenario.fanout, max(scenario.group_size - 1, 0))
    groups = math.ceil(scenario.rollout_nodes / max(1, scenario.group_size))
    leader = scenario.link_gbps
    if scenario.store_gbps > 0:
        leader = min(leader, scenario.store_gbps / groups)
    tree = min(leader, hop / max(copies, 1))
    source = (
        f"the fabric's {scenario.fabric_gbps:g} Gbps (--fabric-gbps)"
        if scenario.fabric_gbps > 0
        else "the hop measured in the costs, at most the link"
    )
    lines.append(
        f"relay tree: a leader downloads at {leader:.2f} Gbps and an inner member sends "
        f"{copies} copies of the delta at {hop:.2f} Gbps ({source}), so the tree streams at "
        f"{tree:.2f} Gbps per member against {per_node:.2f} Gbps for a direct download; it cuts "
        f"store egress {min(scenario.group_size, scenario.rollout_nodes)}-fold and is faster "
        "where the store's share per node is the narrower pipe (--store-gbps)"
    )
    lines.append(
        f"compute: encode and apply use CPU seconds per dense byte measured on "
        f"{costs.machine.get('cpus')} CPUs (load average "
        f"{costs.machine.get('load_average', ['?'])[0]}) with {_bytes(costs.model_bytes)} models, "
        f"split over {scenario.workers} workers per node; GPU kernels (dcr_format/kernels) or more "
        "cores shrink these terms, the network terms stay"
    )
    at, _ = _interp(costs, scenario.change)
    sync = scenario.dense_bytes * at.sync_s_per_byte / scenario.workers
    if at.sync_tail_s_per_byte is None:
        lines.append(
            f"apply: a reader's whole sync ({_seconds(sync)} per node) is added after the "
            "download (these costs do not say how much of it overlaps the download)"
        )
    else:
        tail = scenario.dense_bytes * at.sync_tail_s_per_byte / scenario.workers
        lines.append(
            f"apply: a reader decodes and completes each object's changes as it arrives; of "
            f"its sync ({_seconds(sync)} per node) {_seconds(min(tail, sync))} come after the "
            "last object (measured), the rest overlaps the delta's arrival, and only what "
            "it takes beyond that arrival is added to it"
        )
    return lines


# --- output --------------------------------------------------------------------------------------


def projection_report(scenario: Scenario, costs: Costs) -> dict[str, Any]:
    """Everything ``dcr project --format json`` prints."""
    at, clamped = _interp(costs, scenario.change)
    return {
        "scenario": asdict(scenario),
        "dense_bytes": scenario.dense_bytes,
        "delta_bytes": delta_bytes(scenario, costs),
        "rate_costs": at.model_dump(),
        "rate_outside_measured": clamped,
        "costs_source": costs.source,
        "estimates": [
            {
                "method": e.method,
                "total_s": e.total,
                "terms_s": e.terms,
                "network_s": e.by_kind("network"),
                "compute_s": e.by_kind("compute"),
                "requests_s": e.by_kind("requests"),
                "bytes_per_node": e.moved_bytes,
                "store_egress_bytes": e.store_egress_bytes,
            }
            for e in project(scenario, costs)
        ],
        "references": reference_rows(scenario, costs),
        "why": explain(scenario, costs),
    }


def format_projection(report: dict[str, Any]) -> str:
    """The human form of :func:`projection_report`."""
    s = report["scenario"]
    at = report["rate_costs"]
    lines = [
        f"projection: {format_count(s['params'])} parameters ({_bytes(report['dense_bytes'])} at "
        f"{s['bytes_per_param']:g} B/param), {s['change']:.2%} change, {s['rollout_nodes']} "
        f"rollout nodes, {s['link_gbps']:g} Gbps per node into the cluster, "
        + (f"{s['fabric_gbps']:g} Gbps" if s["fabric_gbps"] > 0 else "the measured relay hop")
        + f" inside it, {s['trainer_nodes']} trainer nodes, "
        f"{s['workers']} workers per node, store "
        + (f"{s['store_gbps']:g} Gbps" if s["store_gbps"] > 0 else "without limit")
        + ", relay groups of "
        f"{s['group_size']} (fan-out {s['fanout']})",
        f"costs: {report['costs_source']}; at {at['rate']:.2%}: "
        f"{at['bytes_per_changed']:.2f} B per changed element, publish "
        f"{at['publish_s_per_byte'] * 1e9:.2f} ns and sync {at['sync_s_per_byte'] * 1e9:.2f} ns "
        "per dense byte per worker"
        + (
            ""
            if at.get("sync_tail_s_per_byte") is None
            else f" ({at['sync_tail_s_per_byte'] * 1e9:.2f} ns of it after the last object)"
        )
        + (
            " (outside the measured rates: nearest measured costs)"
            if report["rate_outside_measured"]
            else ""
        ),
        f"delta: {_bytes(report['delta_bytes'])} "
        f"({report['delta_bytes'] / report['dense_bytes']:.2%} of dense)",
        "",
    ]
    header = ("method", "total", "network", "compute", "requests", "per node", "store egress")
    cells = [list(header)]
    for e in report["estimates"]:
        cells.append(
            [
                e["method"],
                _seconds(e["total_s"]),
                _seconds(e["network_s"]),
                _seconds(e["compute_s"]),
                _seconds(e["requests_s"]),
                _bytes(e["bytes_per_node"]),
                _bytes(e["store_egress_bytes"]),
            ]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append("")
    for e in report["estimates"]:
        terms = ", ".join(f"{name} {_seconds(v)}" for name, v in e["terms_s"].items())
        lines.append(f"{e['method']}: {terms}")
    lines += ["", "against published reference points (this cluster, 2.06 B/param):"]
    cells = [
        [
            "reference",
            "published",
            "projected",
            "projected / published",
            "without compute",
            "largest term",
        ]
    ]
    for r in report["references"]:
        published = (
            _seconds(r["published_s"][0])
            if r["published_s"][0] == r["published_s"][1]
            else f"{r['published_s'][0]:g}-{r['published_s'][1]:g} s"
        )
        cells.append(
            [
                r["reference"],
                published,
                " / ".join(f"{_seconds(v)}" for v in r["projected_s"].values()),
                " / ".join(f"{v:.2f}" for v in r["ratio"].values()),
                " / ".join(f"{_seconds(v)}" for v in r["without_compute_s"].values()),
                " / ".join(r["dominant"].values()),
            ]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    for row in cells:
        lines.append(
            "  ".join(
                c.ljust(w) if i in (0, 5) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    lines.append("(deltas: dcr over S3 / dcr relay tree)")
    lines += ["", "why it differs:"] + [f"- {line}" for line in report["why"]]
    return "\n".join(lines)
