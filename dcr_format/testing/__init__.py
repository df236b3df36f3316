"""Test support for dcr-format and for code built on it (as ``zarr.testing`` is for zarr).

Nothing in the core package imports this namespace; import the modules directly:

- :mod:`dcr_format.testing.servers`: real S3 servers on 127.0.0.1 (moto in-process, the
  JuiceFS gateway), isolated credentials and environment;
- :mod:`dcr_format.testing.faultproxy`: :class:`~dcr_format.testing.faultproxy.FaultProxy`,
  an HTTP proxy that answers chosen S3 requests with faults (500, reset, truncate, ...);
- :mod:`dcr_format.testing.soak`: the soak, a writer and several readers through random
  faults and SIGKILLs (``python -m dcr_format.testing.soak --minutes 5``).

They need the test extras (moto; the JuiceFS binary for the gateway).
"""
