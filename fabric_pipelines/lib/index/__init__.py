"""Vector indexes: FAISS builds, their quality, and the receipts that reproduce them."""
