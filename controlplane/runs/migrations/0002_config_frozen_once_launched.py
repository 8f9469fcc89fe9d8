"""A launched run's config cannot change: the database refuses the UPDATE (not only the services)."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION runs_run_config_frozen() RETURNS trigger AS $$
BEGIN
    IF OLD.launched_at IS NOT NULL
       AND (NEW.config IS DISTINCT FROM OLD.config OR NEW.config_sha256 IS DISTINCT FROM OLD.config_sha256) THEN
        RAISE EXCEPTION 'run %: the config is immutable once launched', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER runs_run_config_frozen
    BEFORE UPDATE ON runs_run
    FOR EACH ROW EXECUTE FUNCTION runs_run_config_frozen();
"""

DROP = """
DROP TRIGGER IF EXISTS runs_run_config_frozen ON runs_run;
DROP FUNCTION IF EXISTS runs_run_config_frozen();
"""


class Migration(migrations.Migration):
    dependencies = [("runs", "0001_initial")]

    operations = [migrations.RunSQL(CREATE, DROP)]
