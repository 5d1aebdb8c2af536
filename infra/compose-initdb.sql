-- Second database of the compose stack's PostgreSQL: MLflow's (Prefect uses `prefect`).
CREATE DATABASE mlflow OWNER paperline;
