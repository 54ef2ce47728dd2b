"""Small models built locally for tests, demos and CPU training runs (nothing downloaded)."""
