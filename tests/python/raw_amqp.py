"""A tiny AMQP 0-9-1 client over a raw socket, for byte-level checks.

Methods are (de)serialised with pika.spec; content header frames are built and read by
hand so the tests see the exact property bytes a broker sends back.
"""

from __future__ import annotations

import socket
import struct

from pika import frame, spec

FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT = 1, 2, 3, 8
FRAME_END = 0xCE


class BrokerClosed(Exception):
    def __init__(self, method):
        super().__init__(f"{type(method).__name__} {method.reply_code} {method.reply_text}")
        self.reply_code = method.reply_code
        self.method = method


class RawAMQP:
    def __init__(self, host, port, user="guest", password="guest", vhost="/", timeout=10,
                 heartbeat=0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self.expect(0, spec.Connection.Start)
        self.send_method(0, spec.Connection.StartOk(
            client_properties={"product": "spillway-raw-test",
                               "capabilities": {"basic.nack": True, "publisher_confirms": True}},
            mechanism="PLAIN", response=f"\0{user}\0{password}", locale="en_US"))
        tune = self.expect(0, spec.Connection.Tune)
        self.frame_max = tune.frame_max or 131072
        self.send_method(0, spec.Connection.TuneOk(channel_max=tune.channel_max or 2047,
                                                   frame_max=self.frame_max, heartbeat=heartbeat))
        self.send_method(0, spec.Connection.Open(virtual_host=vhost))
        self.expect(0, spec.Connection.OpenOk)
        self.send_method(1, spec.Channel.Open())
        self.expect(1, spec.Channel.OpenOk)

    # -- frames --------------------------------------------------------------------------
    def _recv(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("broker closed the socket")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self):
        while True:
            ftype, channel, size = struct.unpack(">BHI", self._recv(7))
            payload = self._recv(size)
            end = self._recv(1)
            assert end[0] == FRAME_END, f"bad frame end {end!r}"
            if ftype != FRAME_HEARTBEAT:
                return ftype, channel, payload

    def send_frame(self, ftype, channel, payload):
        self.sock.sendall(struct.pack(">BHI", ftype, channel, len(payload)) + payload
                          + bytes([FRAME_END]))

    def send_method(self, channel, method):
        self.sock.sendall(frame.Method(channel, method).marshal())

    def read_method(self):
        ftype, channel, payload = self.read_frame()
        assert ftype == FRAME_METHOD, f"expected a method frame, got type {ftype}"
        class_id, method_id = struct.unpack(">HH", payload[:4])
        method = spec.methods[(class_id << 16) | method_id]()
        method.decode(payload, 4)
        return channel, method

    def expect(self, channel, *classes):
        ch, method = self.read_method()
        if isinstance(method, (spec.Connection.Close, spec.Channel.Close)):
            raise BrokerClosed(method)
        assert isinstance(method, classes), f"expected {classes}, got {method}"
        assert ch == channel, f"expected channel {channel}, got {ch}"
        return method

    # -- operations ----------------------------------------------------------------------
    def declare_queue(self, name, **kw):
        self.send_method(1, spec.Queue.Declare(queue=name, **kw))
        return self.expect(1, spec.Queue.DeclareOk)

    def publish(self, exchange, routing_key, raw_props: bytes, body: bytes,
                body_frame_size: int | None = None, mandatory=False):
        """basic.publish with the property list given as raw bytes (flags included)."""
        self.send_method(1, spec.Basic.Publish(exchange=exchange, routing_key=routing_key,
                                               mandatory=mandatory))
        header = struct.pack(">HHQ", 60, 0, len(body)) + raw_props  # class 60 = basic
        self.send_frame(FRAME_HEADER, 1, header)
        step = body_frame_size or (self.frame_max - 8)
        for i in range(0, len(body), step):
            self.send_frame(FRAME_BODY, 1, body[i:i + step])

    def get(self, queue):
        """basic.get (no-ack). Returns None or (get_ok, raw_props, body, body_frames)."""
        self.send_method(1, spec.Basic.Get(queue=queue, no_ack=True))
        method = self.expect(1, spec.Basic.GetOk, spec.Basic.GetEmpty)
        if isinstance(method, spec.Basic.GetEmpty):
            return None
        raw_props, body, frames = self.read_content()
        return method, raw_props, body, frames

    def read_content(self):
        ftype, _, payload = self.read_frame()
        assert ftype == FRAME_HEADER, f"expected a content header, got frame type {ftype}"
        class_id, weight, size = struct.unpack(">HHQ", payload[:12])
        assert class_id == 60 and weight == 0, (class_id, weight)
        raw_props = payload[12:]
        body, frames = b"", 0
        while len(body) < size:
            ftype, _, chunk = self.read_frame()
            assert ftype == FRAME_BODY, f"expected a body frame, got type {ftype}"
            assert len(chunk) + 8 <= self.frame_max, "body frame larger than frame_max"
            body += chunk
            frames += 1
        assert len(body) == size
        return raw_props, body, frames

    def close(self):
        try:
            self.send_method(0, spec.Connection.Close(reply_code=200, reply_text="bye",
                                                      class_id=0, method_id=0))
            self.expect(0, spec.Connection.CloseOk)
        except Exception:
            pass
        finally:
            self.sock.close()


# -- hand-made field tables (every type RabbitMQ's parser knows) --------------------------

def shortstr(s: bytes) -> bytes:
    return struct.pack(">B", len(s)) + s


def longstr(s: bytes) -> bytes:
    return struct.pack(">I", len(s)) + s


def table(items: list[tuple[bytes, bytes]]) -> bytes:
    """items: (name, encoded value incl. its type letter)."""
    return longstr(b"".join(shortstr(k) + v for k, v in items))


def array(values: list[bytes]) -> bytes:
    return longstr(b"".join(values))


def all_field_types_table() -> bytes:
    inner = table([(b"deep", b"S" + longstr(b"nested")), (b"n", b"I" + struct.pack(">i", -1))])
    return table([
        (b"S", b"S" + longstr("unicode \u00e9\u4e2d".encode())),
        (b"I", b"I" + struct.pack(">i", -123456)),
        (b"i", b"i" + struct.pack(">I", 4000000000)),
        (b"l", b"l" + struct.pack(">q", -(2 ** 62))),
        (b"b", b"b" + struct.pack(">b", -5)),
        (b"B", b"B" + struct.pack(">B", 250)),
        (b"s", b"s" + struct.pack(">h", -300)),
        (b"u", b"u" + struct.pack(">H", 65000)),
        (b"f", b"f" + struct.pack(">f", 1.25)),
        (b"d", b"d" + struct.pack(">d", -2.5e100)),
        (b"D", b"D" + struct.pack(">Bi", 2, 31415)),
        (b"t", b"t\x01"),
        (b"t0", b"t\x00"),
        (b"T", b"T" + struct.pack(">Q", 1700000000)),
        (b"x", b"x" + longstr(bytes(range(256)))),
        (b"V", b"V"),
        (b"F", b"F" + inner),
        (b"A", b"A" + array([b"I" + struct.pack(">i", 1), b"S" + longstr(b"two"),
                             b"F" + inner, b"A" + array([]), b"V"])),
        (b"empty", b"S" + longstr(b"")),
    ])


def raw_basic_properties(headers: bytes | None = None, **fields) -> bytes:
    """Encode basic properties by hand: flags word then the present fields in order."""
    order = [
        ("content_type", 15, "s"), ("content_encoding", 14, "s"), ("headers", 13, "F"),
        ("delivery_mode", 12, "o"), ("priority", 11, "o"), ("correlation_id", 10, "s"),
        ("reply_to", 9, "s"), ("expiration", 8, "s"), ("message_id", 7, "s"),
        ("timestamp", 6, "T"), ("type", 5, "s"), ("user_id", 4, "s"), ("app_id", 3, "s"),
        ("cluster_id", 2, "s"),
    ]
    if headers is not None:
        fields["headers"] = headers
    flags, out = 0, b""
    for name, bit, kind in order:
        if name not in fields:
            continue
        v = fields.pop(name)
        flags |= 1 << bit
        if kind == "s":
            out += shortstr(v.encode() if isinstance(v, str) else v)
        elif kind == "F":
            out += v
        elif kind == "o":
            out += struct.pack(">B", v)
        elif kind == "T":
            out += struct.pack(">Q", v)
    assert not fields, f"unknown properties {fields}"
    return struct.pack(">H", flags) + out
