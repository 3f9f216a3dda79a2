"""The parent side of jobs: the device lease, the runner, the job store and event hub, job processes."""
