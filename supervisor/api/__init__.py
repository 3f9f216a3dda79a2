"""HTTP: routes and their helpers."""
