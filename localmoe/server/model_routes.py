"""`GET /v1/models` and `GET /v1/models/{model_id}`, one shape for both SDKs: the OpenAI
fields (`object`, `created`, `owned_by`) and the Anthropic ones (`type`, `display_name`,
`created_at`, and `has_more` / `first_id` / `last_id` on the list)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Path, Request

from localmoe.runtime.service import MODEL_ALIASES, Service
from localmoe.server.errors import APIError

router = APIRouter()


def model_card(service: Service) -> dict:
    """The served model as both APIs describe a model."""
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(service.created))
    return {"id": service.model_id, "object": "model", "created": service.created, "owned_by": "localmoe",
            "type": "model", "display_name": service.model_id, "created_at": created_at,
            "context_length": service.context}


@router.get("/v1/models")
async def models(request: Request):
    """The served model (OpenAI `models.list` and Anthropic `models.list` read the same list)."""
    card = model_card(request.app.state.service)
    return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}


@router.get("/v1/models/{model_id}")
async def model(request: Request, model_id: str = Path(max_length=256)):
    """One model by id (its name, or the aliases `default` and `localmoe`); 404 for any other id."""
    service: Service = request.app.state.service
    if model_id != service.model_id and model_id not in MODEL_ALIASES:
        raise APIError(404, f"model {model_id!r} is not served here; this server serves {service.model_id!r} "
                            f"(GET /v1/models)", param="model_id", code="model_not_found")
    return model_card(service)
