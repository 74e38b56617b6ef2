"""KL-sensitivity placement search: per-group scores, exact ILP, audits and plots."""
