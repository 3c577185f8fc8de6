//! `connection.update-secret` (RabbitMQ's extension) through lapin, in both wirings: the
//! broker answers update-secret-ok and the connection keeps working. Users from
//! configuration have no expiring secret, so any new secret is taken, as RabbitMQ's
//! internal user database does (checked against RabbitMQ 3.10 with the pika test).

use std::time::Duration;

use anyhow::{bail, Context};
use lapin::options::{BasicGetOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;
use spillway_integration_tests::{both_wirings, eventually, Sandbox};

both_wirings!(
    timeout_secs = 60;
    update_secret_is_answered_and_the_connection_goes_on,
);

async fn update_secret_is_answered_and_the_connection_goes_on(
    sandbox: &mut Sandbox,
) -> anyhow::Result<()> {
    let connection = sandbox.connect().await?;
    for secret in ["guest", "a-rotated-token"] {
        connection
            .update_secret(secret.into(), "token refreshed".into())
            .await
            .with_context(|| format!("update-secret with {secret:?}"))?;
    }
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            "after-update".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await?;
    channel
        .basic_publish(
            "".into(),
            "after-update".into(),
            BasicPublishOptions::default(),
            b"still here",
            BasicProperties::default(),
        )
        .await?
        .await?;
    let got = eventually(Duration::from_secs(10), || async {
        channel
            .basic_get("after-update".into(), BasicGetOptions { no_ack: true })
            .await
            .ok()
            .flatten()
    })
    .await?;
    if got.delivery.data != b"still here" {
        bail!("unexpected body {:?}", got.delivery.data);
    }
    channel.close(200, "done".into()).await?;
    connection.close(200, "done".into()).await?;
    Ok(())
}
