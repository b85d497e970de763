"""Graph IR helpers: node meta keys and values, fx graph utilities, the dtype rule on edges,
and the small modules passes put into graphs."""
