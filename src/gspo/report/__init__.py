"""What a run reports: metric sinks and the console (`gspo.report.sinks`), experiment trackers
(`gspo.report.trackers`, `logging.report_to`), and the plots and HTML page of `gspo report`
(`gspo.report.html`)."""
