#!/usr/bin/env python3
"""Opens N connections to a running meshca, holds them in one state, and
prints how much the server's resident memory grew per connection.

Usage: hold_connections.py HOST PORT N STATE SERVER_PID [HOLD_SECONDS]

STATE is one of
  tcp       TCP connected, nothing sent (the server waits for a ClientHello)
  hello     ClientHello sent, the handshake left unfinished
  idle      TLS 1.3 with ALPN h2, the HTTP/2 preface and SETTINGS, then idle
  inflight  idle + one CreateCertificate request whose message never finishes

Run it against a server started for it (nothing else connected), e.g. under
heaptrack to see which crate owns the memory (BENCHMARKS.md, "Memory per
connection, by owner"). Standard library only.
"""
import socket, ssl, struct, sys, time, select

def rss(pid):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
def hwm(pid):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmHWM"): return int(l.split()[1])

host, port, n, state, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols(["h2"])
ctx.minimum_version = ssl.TLSVersion.TLSv1_3

def frame(typ, flags, sid, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([typ, flags]) + struct.pack(">I", sid) + payload

def lit(name, value):  # literal without indexing, new name, no huffman
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"")
HDRS = (b"\x83\x87" + b"\x04" + bytes([len(b"/istio.v1.auth.IstioCertificateService/CreateCertificate")]) +
        b"/istio.v1.auth.IstioCertificateService/CreateCertificate" +
        lit(b":authority", b"meshca") + lit(b"content-type", b"application/grpc") + lit(b"te", b"trailers"))
REQ = frame(1, 4, 1, HDRS) + frame(0, 0, 1, b"\x00\x00\x00\x01\x00" + b"\x0a")  # 5-byte prefix says 256 bytes, send 1

time.sleep(0.5)
base = rss(pid)
socks = []
t0 = time.time()
for i in range(n):
    s = socket.create_connection((host, port))
    if state == "tcp":
        socks.append(s); continue
    if state == "hello":
        t = ctx.wrap_socket(s, do_handshake_on_connect=False)
        t.setblocking(False)
        try: t.do_handshake()
        except ssl.SSLWantReadError: pass
        socks.append(t); continue
    t = ctx.wrap_socket(s)
    assert t.selected_alpn_protocol() == "h2", t.selected_alpn_protocol()
    t.sendall(PREFACE)
    if state == "inflight":
        t.sendall(REQ)
    socks.append(t)
# let the server process everything, then read what it sent (SETTINGS, acks) so kernel buffers drain
time.sleep(3)
for t in socks:
    if state in ("idle", "inflight"):
        t.setblocking(False)
        try:
            while True:
                d = t.recv(65536)
                if not d: break
        except (ssl.SSLWantReadError, BlockingIOError): pass
        if state in ("idle", "inflight"):
            try: t.sendall(frame(4, 1, 0, b""))  # SETTINGS ack
            except Exception: pass
time.sleep(2)
after = rss(pid)
print(f"state={state} n={n} rss_before={base}KiB rss_after={after}KiB per_conn={(after-base)*1024/n:.0f}B hwm={hwm(pid)}KiB open_took={time.time()-t0:.1f}s", flush=True)
if len(sys.argv) > 6:
    time.sleep(float(sys.argv[6]))
