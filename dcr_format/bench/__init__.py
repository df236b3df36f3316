"""The refit benchmark suite (``dcr bench``) and the projection to scale (``dcr project``).

- :mod:`~dcr_format.bench.codec`: delta size against the entropy bound, encode and
  apply speed against ``torch.clone`` (also ``benchmarks/codec_bench.py``);
- :mod:`~dcr_format.bench.refit`: end-to-end refit, dense against dcr, through one
  store (also ``benchmarks/refit_bench.py``);
- :mod:`~dcr_format.bench.fanout`: relay fan-out against independent readers, in
  processes;
- :mod:`~dcr_format.bench.suite`: all of it in one run, one table, one PNG;
- :mod:`~dcr_format.bench.costs`: the measured per-byte and per-object costs;
- :mod:`~dcr_format.bench.projection`: refit time at scale from those costs.
"""
