"""`fakegcs://bucket/key`: a local stand-in for a GCS bucket whose rename is copy + delete (not atomic),
like gcsfs'. Objects are files under $FAKEGCS_ROOT. Importing this module registers the protocol with
fsspec (the crash-resume tests import it in the test process and in the driver they kill)."""
import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

ROOT_ENV = "FAKEGCS_ROOT"


class FakeGCSFileSystem(LocalFileSystem):
    """fakegcs://bucket/key -> $FAKEGCS_ROOT/bucket/key; mv = copy then delete, as on GCS."""
    protocol = ("fakegcs",)
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("fakegcs://"):
            path = os.path.join(os.environ[ROOT_ENV], path[len("fakegcs://"):])
        return path.rstrip("/") or "/"

    def mv(self, path1, path2, **kwargs):
        self.cp_file(path1, path2)
        self.rm_file(path1)


fsspec.register_implementation("fakegcs", FakeGCSFileSystem, clobber=True)
