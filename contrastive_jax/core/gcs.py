"""gs:// paths: a check, before any compute, that Google Cloud credentials exist.

A gs:// workdir or data_dir is read and written by three clients: TensorFlow's
GCS filesystem (tf.io.gfile: TFDS, TensorBoard events, metrics.jsonl, and
Orbax's directories and small files through etils.epath), TensorStore (Orbax's
arrays) and google-cloud-storage (Orbax asks it whether the bucket has a
hierarchical namespace). All three find credentials the same way, as
Application Default Credentials: GOOGLE_APPLICATION_CREDENTIALS, the file that
`gcloud auth application-default login` writes, or a Cloud TPU / GCE VM's
service account from the metadata server. Without any, TensorFlow goes on with
an empty token, and the job fails at its first gs:// access with a traceback
that does not say why (an HTTP 401, or offline "Could not resolve host"). So
jobs call check_credentials first, which asks google-auth (the library behind
google-cloud-storage) and fails within seconds with what to do.

google-auth is imported only to check a gs:// path, so local runs need none of
these clients.

STORAGE_EMULATOR_HOST (the emulator variable of Google's client libraries) skips
the check; tests/gcs_emulator.py says how each client is pointed at an emulator.
"""

import os

from contrastive_jax.core.errors import JobError


def check_credentials(path: str, what: str):
  """Raises JobError if `path` is on gs:// and no Google Cloud credentials are found.

  Args:
    path: a workdir or data directory (any path; only gs:// ones are checked).
    what: how the user gave it, for the message, e.g. '--workdir' or 'config.data_dir'.

  Bounded: google-auth asks the metadata server (169.254.169.254, or
  GCE_METADATA_IP) with a 3 s timeout and 3 attempts (GCE_METADATA_TIMEOUT,
  GCE_METADATA_DETECT_RETRIES); an unreachable address fails at once.
  """
  if not path.startswith("gs://") or os.environ.get("STORAGE_EMULATOR_HOST"):
    return
  import google.auth  # pylint: disable=import-outside-toplevel
  import google.auth.exceptions  # pylint: disable=import-outside-toplevel

  try:
    google.auth.default()
  except google.auth.exceptions.DefaultCredentialsError as e:
    raise JobError(
      f"{what}={path}: no Google Cloud credentials to read or write gs:// with ({e}). "
      "Authenticate with `gcloud auth application-default login`, or set "
      "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file; on a Cloud TPU or GCE "
      "VM, the VM's service account is used (give it access to the bucket)"
    ) from None
