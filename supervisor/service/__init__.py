"""Running as a service: systemd, service commands, pull."""
