#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses into tests/system/fuzz/corpus/ (docs/fuzzing.md).

The store and IDX seeds follow docs/store.md and idx_reader.h; the ring seed is recorded from
two real ranks by the harness itself (DDP_FUZZ_RECORD, see fuzz_ring_peer.cc). Rerun after a
protocol change; the seeds are small, valid examples for the fuzzer to mutate.
"""
import gzip
import os
import struct
import zlib

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



# --- PyTorch's files: pickles (fuzz_pickle_reader) and torch.save's zip archives
# (fuzz_zip_reader), well-formed and hostile (the cases docs/security.md lists), made here, not
# checked in as blobs by hand. The hostile ones are scaled down where their full size would only
# slow the fuzzer (tests/archive and tests/torch run them at full size). ---
def p_str(s):
    s = s.encode()
    return b"X" + struct.pack("<I", len(s)) + s


def p_int(v):
    return b"\x8a\x08" + struct.pack("<q", v)


def p_ints(values):
    return b"(" + b"".join(p_int(v) for v in values) + b"t"


def p_tensor(storage_type, key, numel, offset, size, stride):
    return (b"ctorch._utils\n_rebuild_tensor_v2\n((" + p_str("storage") + b"ctorch\n" +
            storage_type.encode() + b"\n" + p_str(key) + p_str("cpu") + p_int(numel) + b"tQ" +
            p_int(offset) + p_ints(size) + p_ints(stride) +
            b"\x89ccollections\nOrderedDict\n)RtR")


ORDERED_DICT = b"ccollections\nOrderedDict\n)R"


def p_state_dict(entries):
    return (b"\x80\x02" + ORDERED_DICT + b"(" +
            b"".join(p_str(k) + v for k, v in entries) + b"u.")


good_pickle = p_state_dict([
    ("weight", p_tensor("FloatStorage", "0", 6, 0, [2, 3], [3, 1])),
    ("bias", p_tensor("FloatStorage", "1", 2, 0, [2], [1])),
    ("view", p_tensor("FloatStorage", "0", 6, 1, [2], [3])),
])
hostile_pickles = {
    "state_dict": good_pickle,
    "deep_lists": b"\x80\x02" + b"(" * 1000 + b"N" + b"l" * 1000 + b"0" + ORDERED_DICT + b".",
    "dup_bomb": b"\x80\x02N" + b"2\x86" * 26 + b"0" + ORDERED_DICT + b".",
    "huge_memo_index": b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 25) + b"0" + ORDERED_DICT + b".",
    "memo_get_tuple": (b"\x80\x02(" + b"N" * 1000 + b"tq\x01" + b"(" + b"h\x01" * 2000 + b"t0" +
                       b"0" + ORDERED_DICT + b"."),
    "tuple1_chain": b"\x80\x02N" + b"\x85" * 10000 + b"0" + ORDERED_DICT + b".",
    "list_holds_itself": b"\x80\x02]q\x00h\x00a.",
    "os_system": b"\x80\x02cposix\nsystem\n" + p_str("true") + b"\x85R.",
    "newobj": b"\x80\x02ccollections\nOrderedDict\n)\x81.",
    "overflowing_tensor": p_state_dict([
        ("w", p_tensor("FloatStorage", "0", 4, 0, [2, 1 << 62], [1 << 62, 4]))]),
    "huge_numel": p_state_dict([("w", p_tensor("FloatStorage", "0", (1 << 62) + 10, 0, [2], [1]))]),
}
for name, data in hostile_pickles.items():
    write("fuzz_pickle_reader", name, data)


def zip_archive(records, zip64=False):
    """records: (name, data, method (0 or 8), crc or None, declared size or None)."""
    out, directory = b"", b""
    for name, data, method, crc, declared in records:
        name = name.encode()
        body = data
        if method == 8:
            c = zlib.compressobj(9, zlib.DEFLATED, -15)
            body = c.compress(data) + c.flush()
        crc = zlib.crc32(data) if crc is None else crc
        size = len(data) if declared is None else declared
        offset = len(out)
        extra = struct.pack("<HHQQQ", 1, 24, size, len(body), offset) if zip64 else b""
        small = 0xFFFFFFFF if zip64 else None
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, method, 0, 0, crc,
                           small or len(body), small or size, len(name), 0) + name + body
        directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, method, 0, 0, crc,
                                 small or len(body), small or size, len(name), len(extra), 0, 0,
                                 0, 0, small or offset) + name + extra
    directory_offset = len(out)
    out += directory
    if zip64:
        record = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(records),
                           len(records), len(directory), directory_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, record, 1)
        return out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF,
                                 0xFFFFFFFF, 0)
    return out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records),
                             len(directory), directory_offset, 0)


floats = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
bias = struct.pack("<2f", 7, 8)


def torch_archive(pickle, storages, method=0, zip64=False, version=b"3\n"):
    records = [("archive/data.pkl", pickle, method, None, None)]
    records += [("archive/data/" + key, data, method, None, None) for key, data in storages]
    records.append(("archive/version", version, 0, None, None))
    return zip_archive(records, zip64)


storages = [("0", floats), ("1", bias)]
write("fuzz_zip_reader", "state_dict", torch_archive(good_pickle, storages))
write("fuzz_zip_reader", "state_dict_zip64", torch_archive(good_pickle, storages, zip64=True))
write("fuzz_zip_reader", "state_dict_deflated", torch_archive(good_pickle, storages, method=8))
flipped = bytearray(torch_archive(good_pickle, storages))
flipped[flipped.index(floats) + 5] ^= 0x10
write("fuzz_zip_reader", "crc_flipped", bytes(flipped))
small_pickle = p_state_dict([("w", p_tensor("FloatStorage", "0", 10, 0, [10], [1]))])
write("fuzz_zip_reader", "zip_bomb", zip_archive([
    ("archive/data.pkl", small_pickle, 0, None, None),
    ("archive/data/0", bytes(4 << 20), 8, None, None)]))
write("fuzz_zip_reader", "size_lies", zip_archive([
    ("archive/data.pkl", small_pickle, 0, None, None),
    ("archive/data/0", bytes(4096), 8, None, 40)]))
write("fuzz_zip_reader", "hostile_pickle", torch_archive(hostile_pickles["dup_bomb"], []))
# One byte, then an end-of-central-directory record whose empty directory is at byte 5: once
# a read of 0 bytes into no buffer (undefined behaviour, found by this harness).
write("fuzz_zip_reader", "empty_directory",
      b"hPK\x05\x06" + bytes(12) + b"\x01\x00\x00\x00\x05\x00\x00\x00[\x00\x06")

# --- RPC (src/rpc): the first byte picks raw (even: handshake, then frames) or frames after a
# real handshake (odd); handshake.h and frame.h give the layouts ---
def rpc_frame(kind, call_id, timeout_ms, name, payload, flags=0, payload_bytes=None):
    head = struct.pack("<IBBBBQIIQ", 0x43505244, 2, kind, flags, 0, call_id, timeout_ms,
                       len(name), len(payload) if payload_bytes is None else payload_bytes)
    return head + struct.pack("<I", zlib.crc32(head)) + name + payload


def ring_offer(path, domain, capacity=65536):
    return (bytes(range(16)) + struct.pack("<Q", capacity) + struct.pack("<H", len(path)) + path +
            struct.pack("<H", len(domain)) + domain)


RPC_HELLO = struct.pack("<IBBHiii", 0x48505244, 1, 0, 0, 2, 1, 0) + bytes(32)
RPC_MAC = bytes(32)  # no secret: the MACs are zero
echo = rpc_frame(1, 1, 5000, b"echo", b"hi")
write("fuzz_rpc_peer", "raw_session", b"\x00" + RPC_HELLO + RPC_MAC + echo)
write("fuzz_rpc_peer", "raw_hello_only", b"\x00" + RPC_HELLO)
write("fuzz_rpc_peer", "raw_wrong_world", b"\x00" + struct.pack("<IBBHiii", 0x48505244, 1, 0, 0, 3,
                                                                 1, 0) + bytes(32))
write("fuzz_rpc_peer", "frames_echo", b"\x01" + echo + rpc_frame(1, 2, 5000, b"echo", b""))
write("fuzz_rpc_peer", "frames_unknown_function", b"\x01" + rpc_frame(1, 3, 5000, b"nope", b"x"))
write("fuzz_rpc_peer", "frames_reply_on_wrong_way", b"\x01" + rpc_frame(2, 1, 0, b"", b"x"))
big = struct.pack("<IBBHQIIQ", 0x43505244, 2, 1, 0, 5, 5000, 4, 1 << 40)
write("fuzz_rpc_peer", "frames_oversized", b"\x01" + big + struct.pack("<I", zlib.crc32(big)))
# The shared-memory lane (shared_ring.h): a payload in a ring never offered, offers of what is no
# ring (another process's descriptor, a path of another form, a second offer), an answer to an
# offer never made, and a 64 KiB echo whose reply the worker offers its own ring for.
write("fuzz_rpc_peer", "frames_ring_payload_unmapped",
      b"\x01" + rpc_frame(1, 1, 5000, b"echo", b"", flags=1, payload_bytes=100))
write("fuzz_rpc_peer", "frames_ring_offer_not_a_ring",
      b"\x01" + rpc_frame(4, 0, 0, b"", ring_offer(b"/proc/1/fd/0", b"x")) + echo)
write("fuzz_rpc_peer", "frames_ring_offer_twice",
      b"\x01" + rpc_frame(4, 0, 0, b"", ring_offer(b"/etc/passwd", b"x")) +
      rpc_frame(4, 0, 0, b"", ring_offer(b"/proc/self/fd/1", b"")))
write("fuzz_rpc_peer", "frames_ring_answer_unasked",
      b"\x01" + rpc_frame(5, 0, 0, b"", bytes(16) + struct.pack("<H", 0)))
write("fuzz_rpc_peer", "frames_large_echo", b"\x01" + rpc_frame(1, 1, 5000, b"echo", bytes(65536)))
