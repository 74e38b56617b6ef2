"""mixquant.release: the published hashes re-derived from workflow artifacts, and the release bundle."""
