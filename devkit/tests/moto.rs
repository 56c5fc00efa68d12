//! moto's EC2 server as the tests of the cloud side get it: installed by
//! the project's own script, started on loopback, answering the EC2 Query
//! API per region, one server per test.

use berth_devkit::moto::Moto;

#[tokio::test]
async fn moto_answers_the_ec2_query_api_per_region_and_forgets_on_reset() {
    let moto = Moto::start().await.expect("moto starts");
    assert!(moto.endpoint().starts_with("http://127.0.0.1:"));

    // The region comes from the request's credential scope, as with EC2.
    let (status, zones) = moto
        .ec2(
            "eu-west-1",
            "Action=DescribeAvailabilityZones&Version=2016-11-15",
        )
        .await
        .expect("an answer");
    assert_eq!(status, 200, "{zones}");
    assert!(zones.contains("<zoneName>eu-west-1a</zoneName>"), "{zones}");
    assert!(!zones.contains("us-east-1a"), "{zones}");

    // Errors come back as EC2's error document, with EC2's codes.
    let (status, err) = moto
        .ec2(
            "eu-west-1",
            "Action=TerminateInstances&Version=2016-11-15&InstanceId.1=i-0123456789abcdef0",
        )
        .await
        .expect("an answer");
    assert_eq!(status, 400, "{err}");
    assert!(
        err.contains("<Code>InvalidInstanceID.NotFound</Code>"),
        "{err}"
    );

    // A security group made, then forgotten on reset.
    let (status, made) = moto
        .ec2(
            "eu-west-1",
            "Action=CreateSecurityGroup&Version=2016-11-15&GroupName=berth-test&GroupDescription=test",
        )
        .await
        .expect("an answer");
    assert_eq!(status, 200, "{made}");
    let named = "Action=DescribeSecurityGroups&Version=2016-11-15&GroupName.1=berth-test";
    let (status, _) = moto.ec2("eu-west-1", named).await.expect("an answer");
    assert_eq!(status, 200);
    assert!(moto.reset().await, "reset");
    let (status, gone) = moto.ec2("eu-west-1", named).await.expect("an answer");
    assert_eq!(status, 400, "{gone}");
    assert!(gone.contains("InvalidGroup.NotFound"), "{gone}");
}

#[tokio::test]
async fn each_server_is_its_own() {
    let (a, b) = tokio::join!(Moto::start(), Moto::start());
    let (a, b) = (a.expect("a starts"), b.expect("b starts"));
    assert_ne!(a.endpoint(), b.endpoint());
    let make =
        "Action=CreateSecurityGroup&Version=2016-11-15&GroupName=only-in-a&GroupDescription=test";
    assert_eq!(a.ec2("us-east-1", make).await.expect("answer").0, 200);
    let named = "Action=DescribeSecurityGroups&Version=2016-11-15&GroupName.1=only-in-a";
    assert_eq!(a.ec2("us-east-1", named).await.expect("answer").0, 200);
    assert_eq!(b.ec2("us-east-1", named).await.expect("answer").0, 400);
    drop(a);
    drop(b);
}
