"""`rollout dashboard`: a read-only web UI over the run store (see `rollout.dashboard.app`).

Nothing is imported here: fastapi loads only when the command (or a test) imports `app`.
"""
