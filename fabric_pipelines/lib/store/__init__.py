"""The results data plane: SQLAlchemy models, the database connection, the result writer."""
