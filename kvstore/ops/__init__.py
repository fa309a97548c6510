"""Operating the daemon: access traces, tier sizing, the dashboard and the stats views.

``trace`` (record the store's accesses; the trace file), ``mrc`` + ``mrc_chain`` (hit-ratio curves
of the top tier and of the tiers below it), ``advise`` + ``advise_report`` (``kvstore advise``),
``trace_curves`` (the dashboard's curve from the last trace), ``dashboard`` + ``dashboard_page``
(/dashboard), ``stats_view`` (``kvstore stats``'s table and JSON), ``stats_log`` (the daemon's
periodic stats line).
"""
