#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses into tests/fuzz/corpus/ (docs/fuzzing.md).

The store and IDX seeds follow docs/store.md and idx_reader.h; the ring seed is recorded from
two real ranks by the harness itself (DDP_FUZZ_RECORD, see fuzz_ring_peer.cc). Rerun after a
protocol change; the seeds are small, valid examples for the fuzzer to mutate.
"""
import gzip
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


# --- store protocol (little-endian; frame = u32 length, u8 code, fields) ---
SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUMKEYS, CANCEL = range(1, 10)


def b(data):
    data = data.encode() if isinstance(data, str) else data
    return struct.pack("<I", len(data)) + data


def frame(code, fields=b""):
    return struct.pack("<IB", 1 + len(fields), code) + fields


HELLO = struct.pack("<II", 0x53504444, 1)
frames = {
    "set": frame(SET, b("rank/0") + b("127.0.0.1:4000")),
    "get": frame(GET, b("rank/0")),
    "add": frame(ADD, b("count") + struct.pack("<q", 1)),
    "add_overflow": frame(ADD, b("count") + struct.pack("<q", 2**63 - 1))
    + frame(ADD, b("count") + struct.pack("<q", 1)),
    "compare_set": frame(CAS, b("lock") + b("") + b("owner")),
    "check": frame(CHECK, struct.pack("<I", 2) + b("a") + b("b")),
    "wait": frame(WAIT, struct.pack("<I", 1) + b("rank/0")),
    "delete": frame(DELETE, b("rank/0")),
    "num_keys": frame(NUMKEYS),
    "get_missing_cancel": frame(GET, b("missing")) + frame(CANCEL),
}
session = b"".join(frames[k] for k in ["set", "get", "add", "compare_set", "check", "delete",
                                       "num_keys"])
for name, data in frames.items():
    write("fuzz_store_protocol", name, data)
    write("fuzz_store_server", name, HELLO + data)
write("fuzz_store_protocol", "session", session)
write("fuzz_store_server", "session", HELLO + session)
write("fuzz_store_server", "hello_only", HELLO)
write("fuzz_store_server", "old_version", struct.pack("<II", 0x53504444, 0))

# --- ring operation header (comm/wire.h): magic, kind, dtype, op, algorithm, seq, count, root ---
def header(kind, dtype, op, algorithm, seq, count, root):
    return struct.pack("<IBBBBQQii", 0x48504444, kind, dtype, op, algorithm, seq, count, root, 0)


write("fuzz_wire_header", "allreduce", header(0, 0, 0, 1, 7, 1024, -1))
write("fuzz_wire_header", "broadcast", header(1, 0, 0xFF, 4, 3, 16, 0))
write("fuzz_wire_header", "send", header(9, 3, 0xFF, 5, 1, 8, 42) + b"\x01")
write("fuzz_wire_header", "corrupt", header(200, 99, 77, 200, 0, 0, 0))

# --- IDX files (big-endian header, then bytes); first byte = harness mode (fuzz_idx_reader.cc) ---
images = struct.pack(">IIII", 0x803, 1, 28, 28) + bytes(range(256)) * 3 + bytes(16)
labels = struct.pack(">II", 0x801, 3) + bytes([0, 9, 4])
write("fuzz_idx_reader", "images", b"\x00" + images)
write("fuzz_idx_reader", "images_count1", b"\x04" + images)
write("fuzz_idx_reader", "labels", b"\x02" + labels)
write("fuzz_idx_reader", "labels_gzip_raw", b"\x03" + gzip.compress(labels, mtime=0))
write("fuzz_idx_reader", "images_gzip_raw", b"\x01" + gzip.compress(images, mtime=0))
write("fuzz_idx_reader", "truncated", b"\x00" + images[:100])


# --- flight recorder dumps (docs/observability.md); first byte = the rank (fuzz_flight_dump.cc) ---
def flight_entry(seq, op, state, extra=""):
    return ('{"id": %d, "sequence": %d, "channel": "collective", "peer": null, "op": "%s", '
            '"dtype": "float32", "count": 256, "bytes": 1024, "reduce_op": "sum", "root": null, '
            '"algorithm": "ring", "state": "%s", "enqueued_us": %d, "started_us": %d, '
            '"ended_us": %s, "duration_us": null%s}'
            % (seq, seq, op, state, 1000 * seq, 1000 * seq + 1,
               "null" if state == "started" else str(1000 * seq + 9), extra))


def flight_dump(rank, size, entries, reason="timeout", error="rank 0 timed out"):
    return ('{"format": "ddp-flight-recorder", "version": 1, "group": "default", "backend": '
            '"ring", "rank": %d, "size": %d, "job_rank": %d, "job_world_size": %d, "pid": 42, '
            '"host": "h", "dump_time": "2026-11-30T20:00:00.000000Z", "dump_time_unix_us": '
            '1796068800000000, "reason": "%s", "error": "%s", "capacity": 2000, "recorded": %d, '
            '"entries": [%s]}' % (rank, size, rank, size, reason, error, len(entries),
                                  ", ".join(entries))).encode()


write("fuzz_flight_dump", "timeout", b"\x00" + flight_dump(0, 2, [
    flight_entry(0, "allreduce", "completed"), flight_entry(1, "broadcast", "completed"),
    flight_entry(2, "allreduce", "failed")]))
write("fuzz_flight_dump", "behind", b"\x01" + flight_dump(1, 2, [
    flight_entry(0, "allreduce", "completed"), flight_entry(1, "broadcast", "completed")],
    reason="signal"))
write("fuzz_flight_dump", "hang", b"\x02" + flight_dump(2, 4, [
    flight_entry(0, "barrier", "completed"), flight_entry(1, "allreduce", "started")],
    reason="signal"))

