"""The router as an MLflow pyfunc model, logged from code (no pickled objects).

``predict`` takes SLM hidden states (a DataFrame or array of shape (N, H)) and returns P(the SLM is good enough).
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import numpy as np
from mlflow.models import set_model


class RouterModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        from citer.routing.mlp import load_router

        self.router, self.meta = load_router(context.artifacts["router_dir"])

    def predict(self, context, model_input, params=None):  # untyped: MLflow reads type hints as a schema
        import torch

        x = torch.as_tensor(np.asarray(model_input, dtype=np.float32))
        with torch.no_grad():
            return self.router(x).cpu().numpy()


set_model(RouterModel())
