"""HTTP plumbing: the app, its guards (body limit, API key), error bodies, drain."""
