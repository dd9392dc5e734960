"""Ray Serve deployments for TokenFlow (see deployments/app.py)."""
