"""The gateway's HTTP edge: the app, the request guard, kept bodies, the routes, the handoff of
connections between worker processes."""
