"""A local Google Cloud Storage for the gs:// tests: gcp-storage-emulator, in a subprocess.

  emulator = gcs_emulator.start(directory, bucket)   # emulator.env: the variables below
  gcs_emulator.upload(emulator, name, data)
  emulator.stop()

Each client the jobs use on gs:// reaches it (Emulator.env):
- google-cloud-storage (Orbax asks it about the bucket): STORAGE_EMULATOR_HOST.
- TensorStore (Orbax's arrays): TENSORSTORE_GCS_HTTP_URL, its endpoint setting.
- TensorFlow's GCS filesystem (tf.io.gfile: TFDS, TensorBoard events, metrics.jsonl,
  and Orbax's directories and small files through etils.epath) has no endpoint setting:
  it always calls https://www.googleapis.com and https://storage.googleapis.com. Its
  libcurl honours https_proxy and CURL_CA_BUNDLE, so the server is also that proxy: it
  answers CONNECT itself, speaks TLS with a certificate it makes for those two hosts
  (DIRECTORY/cert.pem, the CA bundle) and serves the tunnelled requests. The emulator
  names its resumable-upload URLs http://www.googleapis.com/..., which curl sends through
  http_proxy to the same server.
- TensorFlow and TensorStore take GOOGLE_AUTH_TOKEN_FOR_TESTING as their token and ask
  no credential server; google-cloud-storage is anonymous with STORAGE_EMULATOR_HOST.

Three gaps of gcp-storage-emulator are filled here (see _Handler and _serve): an empty
upload (a directory marker) fails; with both Transfer-Encoding: chunked and
Content-Length (curl through a proxy) it reads the wrong one; downloads lack the
x-goog-generation header TensorStore needs. It serves one request at a time (its
storage is not thread-safe) and ignores preconditions (ifGenerationMatch), which
a single writer does not need.
"""

import datetime
import functools
import http
import http.server
import json
import logging
import os
import ssl
import subprocess
import sys
import threading
from typing import NamedTuple
import urllib.parse
import urllib.request

_HOSTS = ("www.googleapis.com", "storage.googleapis.com")


class Emulator(NamedTuple):
  process: subprocess.Popen
  port: int
  bucket: str
  env: dict

  def stop(self):
    self.process.stdin.close()  # The server exits when its stdin closes.
    try:
      self.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.process.kill()
      raise


def start(directory: str, bucket: str) -> Emulator:
  """Starts the emulator with an empty `bucket`; files it makes go to `directory`."""
  process = subprocess.Popen(
    [sys.executable, __file__, directory, bucket],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  port = int(process.stdout.readline())
  url = f"http://127.0.0.1:{port}"
  env = {
    "STORAGE_EMULATOR_HOST": url,
    "TENSORSTORE_GCS_HTTP_URL": url,
    "https_proxy": url,
    "http_proxy": url,
    "no_proxy": "127.0.0.1,localhost",
    "CURL_CA_BUNDLE": os.path.join(directory, "cert.pem"),
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
  }
  return Emulator(process, port, bucket, env)


def upload(emulator: Emulator, name: str, data: bytes):
  """Writes object `name` of the bucket (a plain JSON-API upload, no client library)."""
  query = urllib.parse.urlencode({"uploadType": "media", "name": name})
  request = urllib.request.Request(
    f"http://127.0.0.1:{emulator.port}/upload/storage/v1/b/{emulator.bucket}/o?{query}",
    data=data,
    method="POST",
    headers={"Content-Type": "application/octet-stream"},
  )
  with urllib.request.urlopen(request, timeout=30) as response:
    json.load(response)


def _write_certificate(directory: str) -> ssl.SSLContext:
  """A self-signed certificate for _HOSTS in directory/cert.pem; its server context."""
  # pylint: disable=g-import-not-at-top
  from cryptography import x509
  from cryptography.hazmat.primitives import hashes
  from cryptography.hazmat.primitives import serialization
  from cryptography.hazmat.primitives.asymmetric import ec

  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "gcs emulator")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (
    x509.CertificateBuilder()
    .subject_name(name)
    .issuer_name(name)
    .public_key(key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(hours=1))
    .not_valid_after(now + datetime.timedelta(days=1))
    .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in _HOSTS]), critical=False)
    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    .sign(key, hashes.SHA256())
  )
  cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
  with open(cert_path, "wb") as f:
    f.write(cert.public_bytes(serialization.Encoding.PEM))
  with open(key_path, "wb") as f:
    f.write(
      key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
      )
    )
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(cert_path, key_path)
  return context


def _serve(directory: str, bucket: str):
  """Serves the emulator and the proxy on one port (printed) until stdin closes."""
  # pylint: disable=g-import-not-at-top
  from gcp_storage_emulator import server as emulator
  from gcp_storage_emulator.handlers import buckets
  from gcp_storage_emulator.handlers import objects
  from gcp_storage_emulator.storage import Storage

  logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # Every 404, else.
  tls = _write_certificate(directory)
  lock = threading.Lock()

  class _Handler(emulator.RequestHandler):
    # HTTP/1.1 to answer "Expect: 100-continue" (curl waits a second for it before each
    # upload); each connection still serves one request (end_headers).
    protocol_version = "HTTP/1.1"

    def parse_request(self):
      ok = super().parse_request()
      if ok and "://" in self.path:  # A proxy request: keep the path and query.
        url = urllib.parse.urlsplit(self.path)
        self.path = urllib.parse.urlunsplit(("", "", url.path, url.query, ""))
      if ok and self.headers.get("Transfer-Encoding", "").lower() == "chunked":
        del self.headers["Content-Length"]  # The body's length is in its chunks.
      return ok

    def end_headers(self):
      if self.command != "CONNECT":
        self.send_header("Connection", "close")
      super().end_headers()

    def do_CONNECT(self):  # pylint: disable=invalid-name
      self.send_response(200, "Connection established")
      self.end_headers()
      self.wfile.flush()
      self.connection = tls.wrap_socket(self.connection, server_side=True)
      self.rfile = self.connection.makefile("rb")
      self.wfile = self.connection.makefile("wb")
      self.close_connection = False
      while not self.close_connection:
        self.handle_one_request()

  for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):

    def serialised(self, handle=getattr(emulator.RequestHandler, f"do_{method}")):
      with lock:
        handle(self)

    setattr(_Handler, f"do_{method}", serialised)

  read_data = emulator._read_data  # pylint: disable=protected-access
  emulator._read_data = lambda handler, query: read_data(handler, query) or b""
  download = objects.download

  def download_with_generation(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    if response.status in (http.HTTPStatus.OK, http.HTTPStatus.PARTIAL_CONTENT):
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      response["x-goog-generation"] = obj["generation"]

  objects.download = download_with_generation  # What objects.get calls for ?alt=media.

  storage = Storage(use_memory_fs=True)
  buckets.create_bucket(bucket, storage)
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, storage))
  threading.Thread(target=lambda: (sys.stdin.read(), httpd.shutdown()), daemon=True).start()
  print(httpd.server_address[1], flush=True)
  httpd.serve_forever()


if __name__ == "__main__":
  _serve(*sys.argv[1:])
