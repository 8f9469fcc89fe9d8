"""Tokens issued before keys were hashed (DRF's ``authtoken_token``, plaintext) keep working: each is
stored hashed here, and the plaintext table is emptied."""

from __future__ import annotations

import hashlib

from django.db import migrations


def import_plaintext_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if "authtoken_token" not in connection.introspection.table_names():
        return
    ApiToken = apps.get_model("access", "ApiToken")
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, user_id, created FROM authtoken_token")
        rows = cursor.fetchall()
        for key, user_id, created in rows:
            ApiToken.objects.get_or_create(
                key_sha256=hashlib.sha256(key.encode()).hexdigest(),
                defaults={"user_id": user_id, "prefix": key[:8], "name": "imported", "created_at": created},
            )
        cursor.execute("DELETE FROM authtoken_token")


class Migration(migrations.Migration):
    dependencies = [("access", "0001_initial")]
    operations = [migrations.RunPython(import_plaintext_tokens, migrations.RunPython.noop)]
