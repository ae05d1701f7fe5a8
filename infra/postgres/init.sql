-- One PostgreSQL for the team setup: the Prefect database is POSTGRES_DB, MLflow gets its own.
CREATE DATABASE mlflow OWNER citer;
