"""The results database, ground floor: SQLAlchemy models, Alembic migrations, connections, keys,
watermarks, write turns and binary COPY payloads. Imports nothing else of lib."""
