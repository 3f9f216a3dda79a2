"""The knowledge base's tables: one migration, appended to the app's list.

Chunks keep their text (what a search returns and the full-text index
reads) and their embedding, a unit-length little-endian float32 BLOB. The
full-text table is an external-content FTS5 index over ``chunks``, kept in
step by triggers, so the text is stored once.

The second migration moves the vectors into blocks (``vector_blocks``): one
row holds the vectors of up to 256 consecutive chunks of a file and their
chunk ids, so a search reads a few hundred rows per 100k chunks instead of
one row each (measured six times faster). Files indexed before it are
indexed again at the next start.
"""

from __future__ import annotations

KNOWLEDGE_SCHEMA: list[str] = [
    """CREATE TABLE files (
        id TEXT PRIMARY KEY,
        owner TEXT,
        filename TEXT NOT NULL,
        purpose TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL,
        is_text INTEGER NOT NULL
    )""",
    "CREATE INDEX files_by_owner ON files (owner, created_at)",
    """CREATE TABLE vector_stores (
        id TEXT PRIMARY KEY,
        owner TEXT,
        name TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        last_active_at INTEGER NOT NULL,
        metadata TEXT NOT NULL,
        model TEXT NOT NULL
    )""",
    "CREATE INDEX vector_stores_by_owner ON vector_stores (owner, created_at)",
    """CREATE TABLE vector_store_files (
        store_id TEXT NOT NULL REFERENCES vector_stores (id) ON DELETE CASCADE,
        file_id TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        status TEXT NOT NULL,
        last_error TEXT,
        usage_bytes INTEGER NOT NULL DEFAULT 0,
        chunk_tokens INTEGER NOT NULL,
        overlap_tokens INTEGER NOT NULL,
        attributes TEXT NOT NULL,
        PRIMARY KEY (store_id, file_id)
    )""",
    "CREATE INDEX vector_store_files_by_file ON vector_store_files (file_id)",
    """CREATE TABLE chunks (
        id INTEGER PRIMARY KEY,
        store_id TEXT NOT NULL,
        file_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        text TEXT NOT NULL,
        vector BLOB NOT NULL
    )""",
    "CREATE INDEX chunks_by_store ON chunks (store_id)",
    "CREATE INDEX chunks_by_file ON chunks (store_id, file_id)",
    "CREATE VIRTUAL TABLE chunks_fts USING fts5 (text, content='chunks', content_rowid='id')",
    """CREATE TRIGGER chunks_fts_insert AFTER INSERT ON chunks BEGIN
        INSERT INTO chunks_fts (rowid, text) VALUES (new.id, new.text);
    END""",
    """CREATE TRIGGER chunks_fts_delete AFTER DELETE ON chunks BEGIN
        INSERT INTO chunks_fts (chunks_fts, rowid, text) VALUES ('delete', old.id, old.text);
    END""",
]

VECTOR_BLOCKS_SCHEMA: list[str] = [
    """CREATE TABLE vector_blocks (
        id INTEGER PRIMARY KEY,
        store_id TEXT NOT NULL,
        file_id TEXT NOT NULL,
        width INTEGER NOT NULL,
        chunk_ids BLOB NOT NULL,
        vectors BLOB NOT NULL
    )""",
    "CREATE INDEX vector_blocks_by_file ON vector_blocks (store_id, file_id)",
    # Chunks from before have their vectors in the column dropped below:
    # their files are indexed again (Knowledge.start resumes in_progress ones).
    "UPDATE vector_store_files SET status = 'in_progress', usage_bytes = 0 WHERE status = 'completed'",
    "DELETE FROM chunks",
    "ALTER TABLE chunks DROP COLUMN vector",
]

# A store's expires_after (anchor last_active_at): its days, NULL for none.
VECTOR_STORE_EXPIRY_SCHEMA: list[str] = [
    "ALTER TABLE vector_stores ADD COLUMN expires_days INTEGER",
]
