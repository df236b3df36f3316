"""Old name of :mod:`dcr_format._stores._s3`, the S3 backend (the same module object).

Kept only while ``tests/test_faults.py`` and ``dcr_format/testing/soak.py`` still name
``dcr_format._s3``; import ``dcr_format._stores._s3`` instead. Importing this name
aliases the real module, so monkeypatching its retry constants still takes effect.
"""

import sys

from dcr_format._stores import _s3

sys.modules[__name__] = _s3
