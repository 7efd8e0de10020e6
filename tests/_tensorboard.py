"""Reads TensorBoard event files back: TFRecord framing (length, masked CRC32C of the
length, payload, masked CRC32C of the payload, every CRC checked with a CRC32C written
here) and the ``Event`` protobuf (tensorboardX's copy of TensorFlow's event.proto; the
``tensorboard`` package itself is not locked)."""

from __future__ import annotations

import glob
import os
import struct

from tensorboardX.proto.event_pb2 import Event


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def events(path: str) -> list[Event]:
    """Every event in one file, each record's two CRCs checked."""
    out = []
    with open(path, "rb") as fh:
        data = fh.read()
    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        assert header_crc == masked_crc(header), f"{path}: bad length CRC at {at}"
        payload = data[at + 12:at + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert payload_crc == masked_crc(payload), f"{path}: bad payload CRC at {at}"
        out.append(Event.FromString(payload))
        at += 16 + length
    return out


def event_files(log_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))


def scalars(log_dir: str) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, value, wall_time), ...]} in file order, over every event file."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for path in event_files(log_dir):
        for event in events(path):
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(
                    (event.step, value.simple_value, event.wall_time))
    return out
