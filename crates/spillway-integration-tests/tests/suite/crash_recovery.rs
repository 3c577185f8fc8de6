//! SIGKILL after publisher confirms: every confirmed persistent message is
//! there after the restart, exactly once and in order.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation};
use spillway_integration_tests::{Sandbox, Wiring};

const MESSAGES: u32 = 2000;

async fn confirmed_messages_survive_sigkill(wiring: Wiring) -> anyhow::Result<()> {
    let mut sandbox = Sandbox::start(wiring).await?;
    {
        let conn = sandbox.connect().await?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare("crash".into(), durable, FieldTable::default())
            .await?;
        let mut confirms = Vec::new();
        for i in 0..MESSAGES {
            let props = BasicProperties::default().with_delivery_mode(2);
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    "crash".into(),
                    BasicPublishOptions::default(),
                    &i.to_be_bytes(),
                    props,
                )
                .await?,
            );
        }
        for confirm in confirms {
            assert!(matches!(confirm.await?, Confirmation::Ack(_)));
        }
        // Killed with the connection still open: no graceful anything.
        sandbox.kill_and_restart().await?;
    }
    let conn = sandbox.connect().await?;
    let ch = conn.create_channel().await?;
    let mut consumer = ch
        .basic_consume(
            "crash".into(),
            "after".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    for expected in 0..MESSAGES {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("consumer ended"))??;
        assert_eq!(delivery.data, expected.to_be_bytes(), "in order, none lost");
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(500), consumer.next())
            .await
            .is_err(),
        "no duplicates"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_all_in_one_keeps_confirmed_messages() {
    confirmed_messages_survive_sigkill(Wiring::AllInOneProcess)
        .await
        .expect("recovered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_separate_processes_keeps_confirmed_messages() {
    confirmed_messages_survive_sigkill(Wiring::Separate)
        .await
        .expect("recovered");
}
