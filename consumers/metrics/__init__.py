"""Metrics consumer: GpuSample/XidEvent records -> dcgm-exporter compatible ``/metrics``.

Pure parts: :mod:`.fields` (DCGM field table), :mod:`.collectors_csv` (counters CSV),
:mod:`.render` (exposition text), :mod:`.store` (:class:`~.store.SeriesStore`). I/O:
:mod:`.http` (:func:`~.http.make_metrics_server`). See ``README.md`` in this folder.
"""
