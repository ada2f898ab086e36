"""What operators see: Prometheus metrics, the status report and page, the logs."""
